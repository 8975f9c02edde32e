"""What the patched SGLang Scheduler keeps: the hook, the decode-step count, the step timer, the RPCs.

The Scheduler subclass (scheduler_patch.py) stays a thin shell over this object so the logic is
testable without SGLang:

    other_batch()                          a prefill / mixed / idle-filler batch is about to launch
    before_decode(batch_size, waiting, s)  before a decode launch: reads finished step timings, builds
                                           the DecodeStepInfo, calls hook.on_decode_step(info)
    after_decode(info)                     the step is queued: closes its timing bracket, calls
                                           hook.after_decode_launch(info) when the hook has it
    control(op, out_path, params)          one control RPC (`OPS`), its result written to a file

RPC results: SGLang's RPC reply carries only success and a message, so every op writes
`{"ok": true, "result": ...}` or `{"ok": false, "error": ...}` as JSON to `<out_path>.<rank>.json`
(one file per scheduler process; rank = torch.distributed rank, 0 without one) and the engine side
reads rank 0's. A failing op also raises, so SGLang reports the RPC as failed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from rollplex.engine.hooks import DecodeStepInfo

from .timing import StepTimer

# control RPCs: hook methods reachable through Engine.collective_rpc ("metrics" is answered here too)
OPS = ("start_admission", "stop_admission", "metrics", "export_prefix_states", "release_prefix_states",
       "update_weights", "export_weights")


def result_path(out_path: str, rank: int) -> str:
    return f"{out_path}.{rank}.json"


def write_result(path: str, payload: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


class HookDriver:
    def __init__(self, hook: Any | None, timer: StepTimer, rank: int = 0,
                 current_stream: Callable[[], Any] | None = None):
        self.hook, self.timer, self.rank = hook, timer, rank
        self.current_stream = current_stream
        self.steps = 0  # decode launches since the scheduler started
        self.other_batches = 0
        self._after = getattr(hook, "after_decode_launch", None) if hook is not None else None

    # ---- the decode loop ----------------------------------------------------------------------
    def other_batch(self) -> None:
        self.other_batches += 1
        self.timer.break_before(self.steps)

    def before_decode(self, batch_size: int, num_waiting: int, stream=None) -> DecodeStepInfo:
        if stream is None and self.current_stream is not None:
            stream = self.current_stream()
        self.timer.poll()
        info = DecodeStepInfo(self.steps, batch_size, self.timer.last_step_ms, num_waiting, stream,
                              self.timer.last_period_ms)
        if self.hook is not None:
            self.hook.on_decode_step(info)
        self.timer.start(self.steps, stream)
        return info

    def after_decode(self, info: DecodeStepInfo) -> None:
        assert info.step == self.steps, "after_decode for a step that is not the one launched"
        self.timer.stop()
        self.steps += 1
        if self._after is not None:
            self._after(info)

    # ---- control RPCs -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        self.timer.poll()
        m = {"rollplex/sglang_decode_steps": float(self.steps),
             "rollplex/sglang_other_batches": float(self.other_batches)}
        if self.timer.last_step_ms is not None:
            m["rollplex/sglang_last_decode_ms"] = self.timer.last_step_ms
        return m

    def control(self, op: str, out_path: str, params: dict[str, Any]) -> Any:
        """Run control op `op` with `params`; its result (or error) goes to result_path(out_path, rank)."""
        path = result_path(out_path, self.rank)
        try:
            result = self._run(op, params)
            write_result(path, {"ok": True, "result": result})
            return result
        except Exception as e:
            write_result(path, {"ok": False, "error": f"{type(e).__name__}: {e}"})
            raise

    def _run(self, op: str, params: dict[str, Any]) -> Any:
        if op not in OPS:
            raise ValueError(f"unknown control op {op!r}; ops are {OPS}")
        if op == "metrics":
            extra = getattr(self.hook, "metrics", None)
            return {**self.metrics(), **(extra(**params) if extra is not None else {})}
        fn = getattr(self.hook, op, None)
        if fn is None:
            what = "no hook" if self.hook is None else f"a {type(self.hook).__name__} without it"
            raise ValueError(f"control op {op!r} needs a hook with a method {op}(); the scheduler has {what}")
        return fn(**params)
