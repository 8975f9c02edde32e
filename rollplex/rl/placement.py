"""Where the passes of scoring and of the actor update run: this process, or a data-parallel group.

Scoring (`Trainer.score`) and the update (`Trainer.accumulate`) are one loop each, written against the
small interface below; the placement decides which of a batch's samples this process computes, how
they are cut into passes, how a pass calls the model, and how per-process results are combined:

    passes(batch, mode, plan, prefix, prompts)   (micro-batch, its real samples' indices in `batch`) per
                                forward/backward over this process's share of the prompts (each with all
                                its samples; `prompts`: these prompts instead); a data-parallel placement
                                may append masked-out dummy samples (rows past the indices), so every rank
                                runs the same passes; prefix: the passes read the rollout's prefix states
                                (no vision tower)
    run(model, fn, *args)       fn(*args): one pass over the model (a sharded model gathers around it)
    sum_(t)                     t summed over the processes, in place
    clip_grad_norm_(params, m)  the gradients' global 2-norm, every gradient scaled so that it is at
                                most m (torch's clip_grad_norm_ over the whole model)
    on_oom()                    what an out-of-memory error means here: "defer" (inside a training pass
                                whose passes run no collective: this process runs no more passes of the
                                mini-batch and `end_passes` backs every process off), "retry" (every
                                process can retry it: one process), or "raise" (other processes wait in
                                a pass's collectives). A `CollectiveOOM`, raised by every process at the
                                same point before a pass, is always retried
    end_passes(model, forward)  after a mini-batch's passes: reduce what they accumulated, or raise
                                CollectiveOOM on every process when one deferred an OOM

`SingleProcess` is the identity placement: every sample here, passes from `micro_batches`, no
communication. `rollplex.parallel.DataParallel` deals prompt groups over the ranks of a process group
with the model sharded by FSDP2. Because both run the same loop, the data-parallel update computes
what the single-process one does by construction (same loss, normalisers, clipping, schedule and
OOM ladder); only the placement's operations above differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from ..models import Qwen25VL
from .batch import RolloutBatch
from .microbatch import MicroBatching, micro_batches


class CollectiveOOM(torch.OutOfMemoryError):
    """Out of memory agreed by every process of a placement at the same point, outside any pass's
    collectives (a pass predicted not to fit on some rank): every process backs off together."""


class Placement(Protocol):
    world: int

    def passes(self, batch: RolloutBatch, mode: str, plan: MicroBatching, prefix: bool = False,
               prompts: list[int] | None = None) -> Iterable[tuple[RolloutBatch, torch.Tensor]]: ...

    def run(self, model: Qwen25VL, fn, *args): ...

    def sum_(self, t: torch.Tensor) -> torch.Tensor: ...

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor: ...

    def on_oom(self) -> str: ...

    def end_passes(self, model: Qwen25VL, forward) -> None: ...


def in_batch(local_idx: torch.Tensor, passes: Iterable[tuple[RolloutBatch, torch.Tensor]]):
    """Passes over a selection of a batch's samples (`local_idx`: their indices in the batch) with each pass's
    sample indices mapped from the selection into the batch."""
    return ((mb, local_idx[idx]) for mb, idx in passes)


class SingleProcess:
    """Every sample in this process, in the micro-batches `micro_batches` plans."""

    world = 1

    def share(self, batch: RolloutBatch, mode: str) -> tuple[RolloutBatch, torch.Tensor]:
        """This process's prompts of `batch` with all their samples, and the samples' indices in `batch`."""
        return batch, torch.arange(batch.num_samples)

    def passes(self, batch: RolloutBatch, mode: str, plan: MicroBatching, prefix: bool = False,
               prompts: list[int] | None = None) -> Iterable[tuple[RolloutBatch, torch.Tensor]]:
        local, local_idx = self.share(batch, mode) if prompts is None else batch.select_prompts(prompts)
        if not local.num_samples:
            return iter(())
        return in_batch(local_idx, micro_batches(local, mode, plan))

    def run(self, model: Qwen25VL, fn, *args):
        return fn(*args)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def on_oom(self) -> str:
        return "retry"

    def end_passes(self, model: Qwen25VL, forward) -> None:
        pass
