"""Where the RL step runs: this process alone, or one rank of a data-parallel group.

`RLStep` (rl/step.py) is written once, against the small interface below; the runtime decides what
the step's models are, where the rollout's samples come from, and which passes each process runs:

    policy                      what the rollout decodes (`RLStep.model`)
    bind_rollout(backend, model, memory)   the rollout backend the step generates on, checked and bound to the
                                policy and the step's memory (ValueError): the one given, or a data-parallel
                                rank's over its engine (prompts dealt over the ranks, every output gathered)
    check(cfg)                  ValueError for a config the runtime cannot run
    place(build, region, trainable, role)   a model placed here: `build()` (the policy, a copy of it as the
                                reference, PPO's value model) in the memory region `region()` enters, as a
                                Trainer (no optimizer yet) over it and where its passes run (a data-parallel
                                rank's: sharded over the group); the step builds the actor, critic and
                                reference on these
    trainer_footprint(trainable, param_bytes, decoder, vision)   (trainable elements held here, bytes
                                the trainer adds to the weights, checkpointing flags) for the memory fit
    weight_bytes()              bytes the built trainer adds to the weights the rollout decodes
    reference_gather(ref) / old_policy(policy, trainer)   what a co-scheduled prefix sweep runs on
    reference_logprobs(reference, ...) / old_logprobs   the scoring passes of the phased step (the
                                reference a Trainer with no optimizer, rl/trainer.py `score`)
    sync_weights() / after_update(actor, m, timed)   the updated weights into what the rollout decodes
    policy_state(policy, trainer, keep)  {name: whole parameter}
    fused                       where the fused schedule's stages run (`FusedPlacement`: its share of the
                                groups, begin / end / abort around the rollout, every rank's results, the
                                stages' scoring and training placement), read by rl/schedule.py only

`LocalRuntime` is the identity runtime: the rollout backend given, every pass here, no communication.
`rollplex.parallel.Colocated` (built by `rollplex.parallel.data_parallel` and injected as
`RLStep(..., parallel=...)`: this package imports nothing of rollplex.parallel) is the data-parallel
one. Because the step is the same code over both, the data-parallel step computes what the
single-process one does; only the operations above differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..models import Qwen25VL
from .actor import Actor
from .batch import RolloutBatch
from .config import RLConfig
from .rollout import RolloutBackend
from .scoring import logprobs
from .trainer import Trainer


class Runtime(Protocol):
    policy: Qwen25VL
    fused: FusedPlacement  # where the fused schedule's stages run

    def bind_rollout(self, backend: RolloutBackend | None, model: Qwen25VL, memory) -> RolloutBackend | None: ...

    def check(self, cfg: RLConfig) -> None: ...

    def place(self, build: Callable[[], torch.nn.Module], region, trainable: bool, role: str) -> Trainer: ...

    def trainer_footprint(self, trainable: int, param_bytes: int, decoder, vision) -> tuple[int, int, bool, bool]: ...

    def weight_bytes(self) -> int: ...

    def reference_gather(self, ref: Qwen25VL): ...

    def old_policy(self, policy: Qwen25VL, trainer: Qwen25VL) -> tuple[Qwen25VL, object]: ...

    def reference_logprobs(self, reference: Trainer, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor: ...

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor: ...

    def sync_weights(self) -> None: ...

    def after_update(self, actor: Actor, m: dict, timed) -> None: ...

    def policy_state(self, policy: Qwen25VL, trainer: Qwen25VL, keep: bool) -> dict | None: ...


class FusedPlacement(Protocol):
    """Where the fused schedule's stages run (rl/schedule.py `Fused`, rl/pipeline.py): one process, or each
    data-parallel rank on its own engine's groups with no collective until the end."""

    def unsupported(self) -> str | None: ...  # why these ranks cannot run a fused step (None: they can)

    def extra_bytes(self, actor: Actor) -> int: ...  # what the fused rollout phase holds besides one process's

    def share(self, num_prompts: int, first: int) -> tuple[list[int], int]: ...  # (my prompts, how many first)

    def begin(self, actor: Actor, ref: Qwen25VL | None) -> None: ...  # before the rollout: models gathered

    def end(self, actor: Actor, ref: Qwen25VL | None, flags: list[int]) -> list[int]: ...  # flags agreed, grads

    def abort(self, actor: Actor, ref: Qwen25VL | None) -> None: ...  # `begin` undone here alone

    def results(self, pipe) -> tuple[list | None, tuple[int, int] | None]: ...  # every rank's chunks

    def reference_logprobs(self, reference: Trainer, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor: ...

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor: ...

    def placement(self): ...  # where the stages' training passes run (None: the actor's)


class LocalRuntime:
    """The step on this process alone: the backend given rolls out `policy`, the trainer's and the
    reference's passes run here (rl/placement.py `SingleProcess`)."""

    def __init__(self, policy: Qwen25VL):
        self.policy = policy
        self.fused = LocalFused(self)

    def bind_rollout(self, backend: RolloutBackend | None, model: Qwen25VL, memory) -> RolloutBackend | None:
        if backend is not None:  # the backend checks it decodes `model` under the step's memory manager
            backend.attach(model, memory)
        return backend

    def check(self, cfg: RLConfig) -> None:
        """Every config runs on one process."""

    @staticmethod
    def place(build: Callable[[], torch.nn.Module], region, trainable: bool, role: str) -> Trainer:
        """`build()` in the region `region()` enters, its passes on this process."""
        with region():
            return Trainer(build(), role=role)

    def trainer_footprint(self, trainable: int, param_bytes: int, decoder, vision) -> tuple[int, int, bool, bool]:
        return trainable, 0, decoder, vision  # the trainer trains the weights the rollout decodes

    def weight_bytes(self) -> int:
        return 0

    def reference_gather(self, ref: Qwen25VL):
        return None

    def old_policy(self, policy: Qwen25VL, trainer: Qwen25VL) -> tuple[Qwen25VL, object]:
        return policy, None

    def reference_logprobs(self, reference: Trainer, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
        return reference.score(batch, logprobs(cfg.temperature), cfg, prefix_key="ref")

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
        return actor.old_logprobs(batch, cfg)

    def sync_weights(self) -> None:
        """Nothing to sync: the rollout decodes the trainer's own tensors (another backend copies them in
        when it enters the rollout)."""

    def after_update(self, actor: Actor, m: dict, timed) -> None:
        pass

    def policy_state(self, policy: Qwen25VL, trainer: Qwen25VL, keep: bool) -> dict | None:
        return {n: p.detach() for n, p in policy.named_parameters()} if keep else None


class LocalFused:
    """The fused schedule on this process alone: every group here, nothing to gather or agree."""

    def __init__(self, runtime: LocalRuntime):
        self.runtime = runtime

    def unsupported(self) -> str | None:
        return None

    def extra_bytes(self, actor: Actor) -> int:
        return 0

    def share(self, num_prompts: int, first: int) -> tuple[list[int], int]:
        return list(range(num_prompts)), first

    def begin(self, actor: Actor, ref: Qwen25VL | None) -> None:
        pass

    def end(self, actor: Actor, ref: Qwen25VL | None, flags: list[int]) -> list[int]:
        return flags

    def abort(self, actor: Actor, ref: Qwen25VL | None) -> None:
        pass

    def results(self, pipe) -> tuple[list | None, tuple[int, int] | None]:
        return None, None  # the pipeline's own chunks are the whole batch's

    def reference_logprobs(self, reference: Trainer, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
        return self.runtime.reference_logprobs(reference, batch, cfg)

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
        return actor.old_logprobs(batch, cfg)

    def placement(self):
        return None  # the actor's own
