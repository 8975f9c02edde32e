"""The fused schedule on a colocated data-parallel rank: each rank's pipeline on its own engine's groups.

`DataParallelFused` is `Colocated.fused` (rl/runtime.py `FusedPlacement`): the trainer and a sharded reference gathered
on every rank before the rollout, the stages' passes run past FSDP2's hooks (`LocalPasses`), one all-reduce
after the last group, every rank's chunks shared for the whole batch's normalisers and metrics. More in
docs/ARCHITECTURE.md ("The step as a pipeline of groups").
"""

from __future__ import annotations

import contextlib

from ..models import Qwen25VL
from ..rl.actor import Actor
from ..rl.runtime import FusedPlacement
from .data_parallel import LocalPasses
from .fsdp import can_call_directly


class DataParallelFused(FusedPlacement):
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

    @contextlib.contextmanager
    def gathered(self, actor: Actor, ref: Qwen25VL | None):
        """The trainer and a sharded reference gathered on every rank for its local passes (a collective), and
        undone on this rank alone when the body (the rollout) fails: no collective."""
        actor.placement.begin_local(actor.model, self._sharded(ref))
        try:
            yield
        except BaseException:
            actor.placement.abort_local(actor.model, self._sharded(ref))
            raise

    def end(self, actor: Actor, ref: Qwen25VL | None, flags: list[int],
            pipe) -> tuple[list[int], list | None, tuple[int, int] | None]:
        """After every rank's fused stages: `flags` agreed over the ranks and, unless one is set, the
        trainer's gradients reduced once into its shards (everything resharded, `DataParallel.end_local`) and
        every rank's chunks (for the whole batch's metrics and later mini-batches) with its (groups trained
        beside decode, groups) summed."""
        flags = actor.placement.end_local(actor.model, self._sharded(ref), flags)
        if any(flags):
            return flags, None, None
        every = self.rank.gather_objects((pipe.shareable(), pipe.counts()))
        return flags, [r for part, _ in every for r in part], tuple(map(sum, zip(*(c for _, c in every))))

    def placement(self) -> LocalPasses:
        """Where the fused stages' passes run, trained and scored: this rank alone, over units `begin` gathered
        (a model held whole called as it is)."""
        return LocalPasses()

    def _sharded(self, ref: Qwen25VL | None) -> list[Qwen25VL]:
        return [ref] if ref is not None and self.rank.fsdp.shard_reference else []
