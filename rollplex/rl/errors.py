"""Why a train step failed, and what of it was applied.

A train step changes the weights only through optimizer steps (one per mini-batch). Anything that
fails before the first one (scoring, any pass of the first mini-batch, a non-finite loss or gradient
norm there) leaves the weights, the optimizer state and the LR schedule as they were:
`weights_changed` is False. A failure after an optimizer step cannot be undone without a copy of
the whole model and optimizer, which the step does not keep; whatever the error (out of memory
`TrainOOM`, a non-finite update `NonFiniteUpdate`, any other `TrainStepFailed`, which it causes), it
is then a TrainStepError saying what was applied:

    applied_updates   whole optimizer steps of this train step that were applied
    partial_update    the next optimizer step stopped part-way: it ran out of memory after updating
                      `chunks_written` of its `chunks_total` parameter chunks, and (`torn`) inside the
                      AdamW update of the next chunk, which may then hold part of it

A step that changed the weights, even partly, advances the LR schedule once (the default
`lr_schedule_unit="step"`, verl's); with "optimizer_step" it advanced once per applied optimizer step,
and once more for one that stopped part-way. `RLStep.train` counts such a step in `step_idx`, and the
server bumps its weights version, so a rollout retained across the failure trains only off-policy
afterwards.
"""

from __future__ import annotations

import traceback


class TrainStepError(RuntimeError):
    def __init__(self, msg: str, applied_updates: int, partial_update: bool = False, chunks_written: int = 0,
                 chunks_total: int = 0, torn: bool = False):
        super().__init__(msg)
        self.applied_updates = applied_updates
        self.partial_update = partial_update
        self.chunks_written, self.chunks_total, self.torn = chunks_written, chunks_total, torn

    @property
    def weights_changed(self) -> bool:
        return self.applied_updates > 0 or self.partial_update

    def applied(self) -> str:
        """What of the step was applied, in words."""
        if not self.weights_changed:
            return "weights, optimizer state and LR schedule are unchanged"
        out = f"{self.applied_updates} optimizer step(s) of this train step were applied"
        if self.partial_update:
            out += (f", and the next one stopped part-way ({self.chunks_written} of {self.chunks_total} parameter "
                    "chunks updated" + (", the next one possibly in part" if self.torn else "") + ")")
        return out


class TrainOOM(TrainStepError):
    """The step ran out of device memory at the smallest micro-batch (scoring or the update), or inside
    an optimizer step."""


class NonFiniteUpdate(TrainStepError):
    """A mini-batch's loss or gradient norm was not finite: its optimizer step was skipped."""


def is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def release_frames(err: BaseException | None) -> None:
    """Clear the finished frames of `err`'s traceback (and of the errors it chains): a failed pass's frames
    hold its activations, which would otherwise stay allocated for as long as the error is kept."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


class TrainStepFailed(TrainStepError):
    """Another error (not out of memory, not a non-finite update) after part of the step was applied: it
    is the cause (`__cause__`); the step counts as one that changed the weights."""
