"""Where the RL step runs: `Runtime` is this process alone; a subclass is one rank of a group.

`RLStep` (rl/step.py) is written once, against the operations below; the runtime decides what the
step's models are, where the rollout's samples come from, and which passes each process runs. This
class answers them for one process: the backend given, every pass here, no communication.
`rollplex.parallel.Colocated` (built by `rollplex.parallel.data_parallel` and injected as
`RLStep(..., parallel=...)`: this package imports nothing of rollplex.parallel) overrides them for one
rank of a data-parallel group. Because the step is the same code over both, the data-parallel step
computes what the single-process one does; only these operations differ.

    policy                      what the rollout decodes (`RLStep.model`)
    bind(backend, model, memory, cfg)   the rollout backend the step generates on; ValueError for a
                                backend or config the runtime cannot run
    place(build, region, trainable, role)   a model (the policy, the reference, PPO's value model)
                                built into its memory region, as a Trainer over it: where its passes run
                                and the gather a co-scheduled prefix sweep of it runs on
    trainer_footprint           what the trainer will hold here, for the memory fit
    old_scorer(actor, cfg)      the Trainer whose scores are the old logprobs (the actor, or one over the
                                policy the rollout decodes); the reference and it score through
                                `Trainer.score` over their placements
    sync_weights(m, timed)      the updated weights into what the rollout decodes
    policy_state                {name: whole parameter}
    fused                       where the fused schedule's stages run (`FusedPlacement`), read by rl/schedule.py
                                and rl/pipeline.py only
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from ..models import Qwen25VL
from .actor import Actor
from .config import RLConfig
from .rollout import RolloutBackend
from .trainer import Trainer


class FusedPlacement:
    """Where the fused schedule's stages run (rl/schedule.py, rl/pipeline.py): here, on this process alone, every
    group here, nothing to gather or agree; a data-parallel rank's (`rollplex.parallel.fused`) runs each rank's
    pipeline on its own engine's groups with no collective until the end."""

    def unsupported(self) -> str | None:
        """Why these ranks cannot run a fused step (None: they can)."""
        return None

    def extra_bytes(self, actor: Actor) -> int:
        """What the fused rollout phase holds besides one process's."""
        return 0

    def share(self, num_prompts: int, first: int) -> tuple[list[int], int]:
        """(the prompts whose groups this process's pipeline gets, how many of them are among the `first`)."""
        return list(range(num_prompts)), first

    @contextlib.contextmanager
    def gathered(self, actor: Actor, ref: Qwen25VL | None):
        """Around the rollout: the models the stages run on gathered, undone on this process alone when the
        body fails (`end` takes them back otherwise)."""
        yield

    def end(self, actor: Actor, ref: Qwen25VL | None, flags: list[int],
            pipe) -> tuple[list[int], list | None, tuple[int, int] | None]:
        """After the stages: (`flags` agreed over the ranks, and unless one is set every rank's chunks and
        counts: None when the pipeline's own are the whole batch's), the gradients reduced."""
        return flags, None, None

    def placement(self):
        """Where the stages' passes run, trained and scored (None: each trainer's own)."""
        return None


class Runtime:
    """The step on this process alone (see the module docstring)."""

    def __init__(self, policy: Qwen25VL):
        self.policy = policy
        self.fused = FusedPlacement()

    def bind(self, backend: RolloutBackend | None, model: Qwen25VL, memory, cfg: RLConfig) -> RolloutBackend | None:
        """The backend the step rolls out on, checked to decode `model` under the step's memory manager;
        ValueError for a backend or config this runtime cannot run (one process runs every config)."""
        if backend is not None:
            backend.attach(model, memory)
        return backend

    @staticmethod
    def place(build: Callable[[], torch.nn.Module], region, trainable: bool, role: str) -> Trainer:
        """`build()` in the region `region()` enters, as a Trainer (no optimizer) whose passes run here (a
        co-scheduled sweep of it too: held whole, it needs no gather)."""
        with region():
            return Trainer(build(), role=role)

    def trainer_footprint(self, trainable: int, param_bytes: int, decoder, vision) -> tuple[int, int, bool, bool]:
        """(trainable elements held here, bytes the trainer adds to the weights the rollout decodes, the
        checkpointing flags with the runtime's own): here the trainer trains the weights the rollout decodes."""
        return trainable, 0, decoder, vision

    def old_scorer(self, actor: Actor, cfg: RLConfig) -> Trainer:
        """The trainer whose scores (`Trainer.score`) are the old logprobs under `cfg`: here the actor's own."""
        return actor

    def sync_weights(self, m: dict | None = None, timed=contextlib.nullcontext) -> None:
        """After an update: the trainer's weights into what the rollout decodes (timed by `timed()`), and their
        metrics into `m`. Here nothing: the rollout decodes the trainer's own tensors (another backend copies them
        in when it enters the rollout)."""

    def policy_state(self, policy: Qwen25VL, trainer: Qwen25VL, keep: bool) -> dict | None:
        """{name: whole parameter} of the policy (where `keep`; a collective on a group)."""
        return {n: p.detach() for n, p in policy.named_parameters()} if keep else None
