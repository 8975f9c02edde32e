"""The decode-loop hook: how a co-scheduler learns about each decode iteration.

The engine calls `on_decode_step(info)` once per decode iteration, *before* launching the step, with
what a co-scheduler needs to decide how much prefix work to admit next to it: the running batch
size, the step index, the measured duration of the last completed decode step and the stream decode
runs on. With no hooks registered the engine skips building the info object entirely.

Two optional methods: `after_decode_launch(info)`, called once that step is queued on the device (work
launched then runs beside it, and its host-side launch cost overlaps the device's decode), and
`on_prefill(requests)`, called after a prefill batch is queued (the engine's Request objects, whose
`vision_embeds` are set when they asked to keep them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class DecodeStepInfo:
    step: int  # decode iterations since the engine started
    batch_size: int  # running sequences in this step
    # measured duration of the most recent decode step that has completed (None at first); with
    # overlap scheduling that is the step before the previous one, which is still running
    last_step_ms: float | None
    num_waiting: int  # requests / preempted sequences not yet running
    stream: Any = None  # torch.cuda.Stream decode is launched on (None on CPU)
    # end-to-end time between the ends of the last two completed decode steps when they were consecutive
    # (None otherwise): unlike last_step_ms it includes gaps where the device waited for the host
    last_period_ms: float | None = None
    # (step, ms): the GPU time of that completed step's model forward alone (the graph replay: no host
    # work inside, so it grows only when other kernels share the device); timed only while hooks listen
    last_forward: tuple[int, float] | None = None
    # host ms the previous decode launch took (inputs, graph replay, sampler, copies; no waiting on the
    # device), measured while hooks listen: it grows when the loop's host work waits, e.g. for the GIL
    last_launch_ms: float | None = None


@runtime_checkable
class DecodeHook(Protocol):
    def on_decode_step(self, info: DecodeStepInfo) -> None: ...


class RecordingHook:
    """Keeps every DecodeStepInfo it sees (tests, timelines)."""

    def __init__(self):
        self.infos: list[DecodeStepInfo] = []

    def on_decode_step(self, info: DecodeStepInfo) -> None:
        self.infos.append(info)
