"""Decode-step timing from device events, read without waiting for the device.

`start(step)` / `stop()` bracket one decode launch with two events on the stream decode runs on;
`poll()` reads every bracketed step that has completed (`event.query()`, never a synchronize), in launch
order, and updates

    last_step_ms     GPU time of the latest completed step (start to end event)
    last_period_ms   end of the previous completed step to the end of this one, when the two were
                     consecutive decode steps with no other batch between them; None otherwise

which are DecodeStepInfo's `last_step_ms` / `last_period_ms` (rollplex/engine/hooks.py). A prefill
(or any non-decode batch) between two decode steps calls `break_before(step)`: the period would include
that batch. Without a device (`make_event=None`) nothing is measured and both stay None.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any


class StepTimer:
    def __init__(self, make_event: Callable[[], Any] | None):
        self.make_event = make_event
        self.last_step_ms: float | None = None
        self.last_period_ms: float | None = None
        self._open: tuple[int, Any, Any] | None = None  # step, start event, stream
        self._pending: deque[tuple[int, Any, Any]] = deque()  # step, start, end: launched, not yet read
        self._last_end: tuple[int, Any] | None = None  # step, end event of the latest completed step
        self._breaks: set[int] = set()  # steps whose period would span a non-decode batch

    @property
    def enabled(self) -> bool:
        return self.make_event is not None

    def start(self, step: int, stream=None) -> None:
        if self.make_event is None:
            return
        assert self._open is None, "start() twice without stop()"
        ev = self.make_event()
        ev.record(stream) if stream is not None else ev.record()
        self._open = (step, ev, stream)

    def stop(self) -> None:
        if self.make_event is None:
            return
        assert self._open is not None, "stop() without start()"
        step, start, stream = self._open
        self._open = None
        end = self.make_event()
        end.record(stream) if stream is not None else end.record()
        self._pending.append((step, start, end))

    def break_before(self, step: int) -> None:
        """A non-decode batch ran after decode step `step - 1`: step `step` has no period."""
        self._breaks.add(step)

    def poll(self) -> None:
        while self._pending and self._pending[0][2].query():
            step, start, end = self._pending.popleft()
            self.last_step_ms = float(start.elapsed_time(end))
            prev, self._last_end = self._last_end, (step, end)
            consecutive = prev is not None and prev[0] == step - 1 and step not in self._breaks
            self.last_period_ms = float(prev[1].elapsed_time(end)) if consecutive else None
            self._breaks = {s for s in self._breaks if s > step}

    @property
    def in_flight(self) -> int:
        return len(self._pending)
