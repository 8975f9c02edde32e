"""What every trainer of a step shares (the actor's, the critic's): one model, its MasterAdamW, where its
passes run, the optimizer step agreed over the placement's ranks, and what a failed update reports.

An update applies one optimizer step per mini-batch (`applied` counts them). `optimizer_step` runs one:
out of memory inside it raises TrainOOM on every rank of a data-parallel placement (they agree with one
all-reduce), saying what it wrote. `failure` is what an update raises for an error: as it is before the
first optimizer step (nothing changed), TrainStepFailed saying what was applied after one (rl/errors.py).
"""

from __future__ import annotations

import torch

from .errors import TrainOOM, TrainStepError, TrainStepFailed, is_oom
from .optimizer import MasterAdamW, OptimizerStepOOM
from .placement import CollectiveOOM, Placement


class Trainer:
    def __init__(self, model: torch.nn.Module, optimizer: MasterAdamW, placement: Placement, memory=None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, per_optimizer_step: bool = False,
                 name: str = "the trainer"):
        """scheduler: an LR schedule stepped here after an optimizer step that wrote weights and failed, when
        `per_optimizer_step` (its unit); name: how errors call it ("the actor")."""
        self.model, self.optimizer, self.placement, self.memory = model, optimizer, placement, memory
        self.scheduler, self.per_optimizer_step, self.name = scheduler, per_optimizer_step, name
        self.applied = 0  # optimizer steps the current (or last) update applied

    def optimizer_step(self, applied: int) -> None:
        """The mini-batch's optimizer step. Out of memory inside it raises TrainOOM on every process of the
        placement (they agree with one all-reduce over several), another error TrainStepFailed, saying what
        was written: `applied` whole steps before it, and whether this one wrote any chunk on some process,
        in which case it counts as applied for the LR schedule (stepped here per optimizer step, by the
        caller per train step)."""
        pl, err, other = self.placement, None, None
        try:
            self.optimizer.step()
        except OptimizerStepOOM as e:
            err = e
        except Exception as e:  # noqa: BLE001 - out of memory outside MasterAdamW's chunks, or another error
            err = OptimizerStepOOM(0, len(self.optimizer.chunks), True)  # either may have written some: assume so
            err.__cause__ = e
            other = None if is_oom(e) else e
        failed, changed, failed_other = err is not None, err is None or err.changed, other is not None
        if pl.world > 1:
            flags = pl.sum_(torch.tensor([float(failed), float(changed), float(failed_other)]))
            failed, changed, failed_other = bool(flags[0] > 0), bool(flags[1] > 0), bool(flags[2] > 0)
        if not failed:
            return
        self.recover()
        if changed and self.per_optimizer_step and self.scheduler is not None:
            self.scheduler.step()
        written, chunks = (err.written, err.total) if err is not None else (len(self.optimizer.chunks),) * 2
        torn = err is not None and err.torn
        if failed_other:  # not out of memory (on some rank): whatever it wrote is kept, and said
            cause = other or RuntimeError("the optimizer step failed on another data-parallel rank")
            raise TrainStepFailed(f"{self.name}'s optimizer step failed: {type(cause).__name__}: {cause}", applied,
                                  partial_update=changed, chunks_written=written, chunks_total=chunks,
                                  torn=torn) from cause
        cause = err if pl.world == 1 else CollectiveOOM("a data-parallel rank ran out of device memory in the "
                                                        "optimizer step")
        raise TrainOOM(f"{self.name}'s optimizer step ran out of device memory ({err or 'on another rank'}); "
                       "offload the optimizer state (optimizer_offload) or lower the memory the step holds",
                       applied, partial_update=changed, chunks_written=written, chunks_total=chunks,
                       torn=torn) from cause

    def recover(self) -> None:
        """Drop a failed pass's gradients and cached blocks (its tensors are gone with the exception)."""
        self.optimizer.zero_grad(set_to_none=self.memory is None)
        if self.model.inv_freq.device.type == "cuda":
            torch.cuda.empty_cache()

    def failure(self, error: BaseException, applied: int) -> BaseException:
        """What an update that failed with `error` after `applied` optimizer steps raises: a TrainStepError
        (it says what was applied) or an error before any optimizer step as it is; any other error after
        one as a TrainStepFailed saying so, caused by it."""
        if isinstance(error, TrainStepError) or not isinstance(error, Exception) or applied == 0:
            return error
        out = TrainStepFailed(f"{self.name}'s update failed after an optimizer step: {type(error).__name__}: "
                              f"{error}", applied)
        out.__cause__ = error
        return out
