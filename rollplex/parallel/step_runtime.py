"""What the RL step asks of a colocated data-parallel rank: `Colocated` as an `rl.runtime.Runtime`.

`rl.step.RLStep` is one piece of code over a runtime (rl/runtime.py); `rl.runtime.LocalRuntime` runs
it on one process, and `Colocated` (parallel/colocated.py), which mixes in `StepRuntime`, on each rank
of a process group. The operations here are the data-parallel answers to the runtime's questions,
written against the group Colocated builds (its engine, FSDP config, rollout groups, shared weights):

    rollout    `DataParallelRollout`: the rank's engine as the step's rollout backend, the prompts dealt
               over the rollout groups and every output gathered to every rank
    models     placed by `Colocated.place`: the trainer, the reference and a critic's value model sharded
               over the group into their regions (or the reference whole on every rank)
    footprint  a rank's share of the trainable elements, the separate trainer shards' bytes, FSDP's
               own checkpointing flags
    scoring    a model each rank holds whole (the old policy with a per-rank engine, a reference not
               sharded) is scored by each rank on its share (`share_logprobs`); a sharded one over the
               trainer's placement
    weights    after an update the engine's tensors rebuilt from the trainer's shards (`sync_weights`),
               the whole policy gathered from them under a tensor-parallel engine (`full_state`)
    fused      `DataParallelFused`: each rank's pipeline on its own engine's groups (rl/pipeline.py)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models import Qwen25VL
from ..rl.actor import Actor
from ..rl.config import RLConfig
from ..rl.placement import SingleProcess
from ..rl.rollout import NativeRollout
from ..rl.scoring import logprobs
from ..rl.trainer import Trainer
from .data_parallel import LocalPasses
from .fsdp import can_call_directly


class StepRuntime:
    """The RL step's runtime operations on a `Colocated` rank (see the module docstring). Reads Colocated's
    engine, fsdp, world, groups, rollout_group, rollout, policy, weights and its rollout and weight methods."""

    # ---- rollout and footprint -----------------------------------------------------------------------
    def bind_rollout(self, backend, model: Qwen25VL, memory):
        """The backend this rank rolls out on (`DataParallelRollout` over the engine this group was built over,
        or None without one): the step's must be that engine, under the step's memory."""
        engine = backend.engine if isinstance(backend, NativeRollout) else None
        if backend is not None and engine is None:
            raise ValueError(f"a data-parallel RL step needs the native rollout backend, not {backend.name}")
        if self.engine is not engine:
            raise ValueError("the data-parallel placement was built over another engine than the step's")
        if engine is None:
            return None
        out = DataParallelRollout(self)
        out.attach(model, memory)
        return out

    @staticmethod
    def check(cfg: RLConfig) -> None:
        if cfg.cosched and cfg.schedule == "fused":
            # each rank co-schedules the prefixes its engine prefilled, a sharded model's as one sweep in
            # lockstep with the other ranks': a chunk's worker cannot take a job over without a collective
            raise ValueError("cosched with schedule='fused' runs on one process only: a data-parallel step "
                             "co-schedules prefixes with schedule='phased', or fuses without cosched")

    def trainer_footprint(self, trainable: int, param_bytes: int, decoder, vision) -> tuple[int, int, bool, bool]:
        """(this rank's share of the trainable elements, the bytes its shards add to the engine's weights where
        they are not windows of them, checkpointing with FSDP's own flags as choices given)."""
        n = -(-trainable // self.world)
        weights = 0 if self.fsdp.share_policy_storage else n * param_bytes
        return (n, weights, True if self.fsdp.activation_checkpointing else decoder,
                True if self.fsdp.vision_activation_checkpointing else vision)

    # ---- scoring ------------------------------------------------------------------------------------
    def reference_logprobs(self, reference: Trainer, batch, cfg: RLConfig) -> torch.Tensor:
        if not self.fsdp.shard_reference:  # each rank its share
            return self.share_logprobs(reference, batch, cfg, "ref")
        return reference.score(batch, logprobs(cfg.temperature), cfg, prefix_key="ref")

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch, cfg: RLConfig) -> torch.Tensor:
        if cfg.num_updates > 1 and self.holds_policy:  # each rank its share, on the policy its engine decodes
            return self.share_logprobs(Trainer(policy, role="old-logprob", score_backoff=actor.score_backoff), batch,
                                       cfg, "old")
        return actor.old_logprobs(batch, cfg)

    def reference_gather(self, ref: Qwen25VL):
        """The gather a co-scheduled sweep of the reference runs on: a sharded one's (None: held whole)."""
        return self.sweep_gather(ref) if self.fsdp.shard_reference else None

    def old_policy(self, policy: Qwen25VL, trainer: Qwen25VL) -> tuple[Qwen25VL, object]:
        """(the model whose prefixes the old logprobs read, its sweep's gather): the policy a per-rank engine
        decodes, or the trainer's shards (a tensor-parallel engine holds only its own)."""
        if self.holds_policy:
            return policy, None
        return trainer, self.sweep_gather(trainer)

    # ---- weights ------------------------------------------------------------------------------------
    def after_update(self, actor: Actor, m: dict, timed) -> None:
        """The trainer's new weights into what the engine decodes (timed by `timed()`), and the metrics."""
        with timed():
            self.sync_weights()
        m.update(self.weight_metrics())
        m.update(actor.placement.take_metrics())

    def policy_state(self, policy: Qwen25VL, trainer: Qwen25VL, keep: bool) -> dict | None:
        if self.holds_policy:
            return {n: p.detach() for n, p in policy.named_parameters()} if keep else None
        return self.full_state(trainer, keep)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable, on the host), in rank order."""
        every: list = [None] * self.world
        dist.all_gather_object(every, obj, group=self.group)
        return every


class DataParallelFused:
    """The fused schedule on a `Colocated` rank (rl/runtime.py `FusedPlacement`): each rank's pipeline on its own
    engine's groups, the trainer and a sharded reference gathered before the rollout, passes past FSDP2's hooks
    (`LocalPasses`), one all-reduce after the last group that agrees on failures and reduces the gradients,
    every rank's chunks shared for the whole batch's normalisers and metrics."""

    def __init__(self, rank):
        self.rank = rank  # the Colocated rank: its engine's rollout group, FSDP config and process group

    def unsupported(self) -> str | None:
        """Why this group cannot run a fused step (None: it can): each rank's pipeline needs its own engine
        and passes that run no collective (`DataParallel.begin_local`)."""

        if self.rank.rollout != "data":
            return "a tensor-parallel rollout decodes every group on several ranks: fused needs a per-rank engine"
        if not can_call_directly(self.rank.fsdp):
            return "fused data-parallel passes run past FSDP2's hooks, which a mixed-precision policy needs"
        return None

    def extra_bytes(self, actor: Actor) -> int:
        """What the fused rollout phase holds here besides one process's: the trainer's units and gradients,
        and a sharded reference's units, gathered."""
        dp = actor.placement
        return dp.unsharded_bytes + (dp.gathered_bytes if self.rank.fsdp.shard_reference else 0)

    def share(self, num_prompts: int, first: int) -> tuple[list[int], int]:
        """(the prompts this rank's engine generates, how many of them are among the `first` groups of the
        whole rollout to finish): the finishing order interleaves the engines' (`_finished`), so this is
        known before any group finishes."""
        keys = sorted(k * self.rank.groups + g for g in range(self.rank.groups)
                      for k in range(len(range(g, num_prompts, self.rank.groups))))
        cut = keys[first - 1] if first else -1
        share = self.rank.group_prompts(num_prompts)
        return share, sum(k * self.rank.groups + self.rank.rollout_group <= cut for k in range(len(share)))

    def begin(self, actor: Actor, ref: Qwen25VL | None) -> None:
        """The trainer and a sharded reference gathered on every rank for its local passes (a collective)."""
        actor.placement.begin_local(actor.model, self._sharded(ref))

    def end(self, actor: Actor, ref: Qwen25VL | None, flags: list[int]) -> list[int]:
        """After every rank's fused stages: `flags` agreed over the ranks and, unless one is set, the
        trainer's gradients reduced once into its shards; everything resharded (`DataParallel.end_local`)."""
        return actor.placement.end_local(actor.model, self._sharded(ref), flags)

    def abort(self, actor: Actor, ref: Qwen25VL | None) -> None:
        """`begin` undone on this rank alone (a failed rollout: no collective)."""
        actor.placement.abort_local(actor.model, self._sharded(ref))

    def results(self, pipe) -> tuple[list, tuple[int, int]]:
        """Every rank's chunks (for the whole batch's metrics and later mini-batches) and its (groups trained
        beside decode, groups) summed."""
        every = self.rank.gather_objects((pipe.shareable(), pipe.counts()))
        return [r for part, _ in every for r in part], tuple(map(sum, zip(*(c for _, c in every))))

    def reference_logprobs(self, reference: Trainer, batch, cfg: RLConfig) -> torch.Tensor:
        """The reference's logprobs of some finished groups, scored by this rank alone."""
        local = self.local_passes() if self.rank.fsdp.shard_reference else SingleProcess()
        return reference.score(batch, logprobs(cfg.temperature), cfg, placement=local)

    def old_logprobs(self, policy: Qwen25VL, actor: Actor, batch, cfg: RLConfig) -> torch.Tensor:
        """Old logprobs of some finished groups, by this rank alone on the policy its engine decodes."""
        return Trainer(policy, role="old-logprob", score_backoff=actor.score_backoff).score(
            batch, logprobs(cfg.temperature), cfg)

    def placement(self) -> LocalPasses:
        """Where the fused stages' training passes run: this rank alone, over units `begin` gathered."""
        return self.local_passes()

    @staticmethod
    def local_passes() -> LocalPasses:
        """The placement of this rank's fused passes over a sharded model gathered by `begin`."""
        return LocalPasses()

    def _sharded(self, ref: Qwen25VL | None) -> list[Qwen25VL]:
        return [ref] if ref is not None and self.rank.fsdp.shard_reference else []


class DataParallelRollout(NativeRollout):
    """A `Colocated` rank's engine as the step's rollout backend: the prompts dealt round-robin over the rollout
    groups, each group's engine generating its share, every rank getting every output (`Colocated.generate`);
    the co-scheduler's share is the prompts this rank's engine prefilled (`Colocated.share`)."""

    def __init__(self, rank):
        super().__init__(rank.engine)
        self.rank = rank

    def generate(self, prompts, params, keep_vision: bool = False, on_output=None) -> list:
        return self.rank.generate(prompts, params, keep_vision=keep_vision, on_output=on_output)

    def share(self, num_prompts: int) -> list[int]:
        return self.rank.share(num_prompts)

    def attach(self, model, memory) -> None:
        """The engine decodes the rank's policy (or its tensor-parallel shard); it must share the step's memory."""
        if memory is not None and self.engine.memory is not memory:
            raise ValueError("the engine and the RL step must share one memory manager")
