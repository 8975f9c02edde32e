"""How a demo run ends, whichever way it ends: at its target, at its step budget, on Ctrl-C or on SIGTERM.

    with Signals() as signals:          # SIGTERM raises KeyboardInterrupt too, as SIGINT does
        ... steps ...                   # `except KeyboardInterrupt`: the run stops where it is
    with signals.ignored():             # a second Ctrl-C while the run's files are written is ignored
        write plot, summary.json
    raise SystemExit(signals.exit_code) # 130 after SIGINT, 143 after SIGTERM: no traceback

`summary(history, ...)` is the run's result as a dict (written to LOG_DIR/summary.json) and `summary_line`
the sentence printed at the end: the first step's reward, the stopping statistic (the mean reward of the
last `window` steps, fewer when the run had fewer), the step it reached the target at, and why it stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Signals:
    """SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread; `received` says which came."""

    def __init__(self):
        self.received: int | None = None
        self._old: dict[int, object] = {}

    def _handler(self, signum, frame):
        self.received = signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in EXIT_CODES:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}
        return False

    @property
    def name(self) -> str:
        return "SIGTERM" if self.received == signal.SIGTERM else "Ctrl-C"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.received or signal.SIGINT, 130)

    @contextlib.contextmanager
    def ignored(self):
        """Both signals ignored inside (the run's files are being written)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, signal.SIG_IGN) for s in EXIT_CODES}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def summary(history: list[dict], target: float, window: int, stopped: str, seconds: float, **about) -> dict:
    """The run's result: steps, the first step's reward, the stopping statistic at the end, the step the target
    was reached at (None if not), why it stopped ("target", "steps", "Ctrl-C", "SIGTERM", "an error"), and `about`."""
    rewards = [h["critic/score/mean"] for h in history]
    last = rewards[-window:]
    reached = next((i + 1 for i in range(window - 1, len(rewards))
                    if sum(rewards[i + 1 - window:i + 1]) / window >= target), None)
    return {"steps": len(rewards), "stopped": stopped, "target": target, "window": window, "reached_at": reached,
            "first_reward": rewards[0] if rewards else None,
            "last_mean": sum(last) / len(last) if last else None, "last_window": len(last),
            "seconds": round(seconds, 1), **about}


def summary_line(s: dict) -> str:
    if not s["steps"]:
        return f"stopped ({s['stopped']}) before the first step finished: nothing trained, {s['seconds']:.0f}s total"
    window = "the last step" if s["last_window"] == 1 else f"the last {s['last_window']} steps"
    head = (f"mean reward: {s['first_reward']:.2f} (step 1) -> {s['last_mean']:.2f} (mean of {window}) in "
            f"{s['steps']} steps, {s['seconds']:.0f}s total")
    if s["reached_at"] is not None:
        return f"{head}; reached the target {s['target']:g} at step {s['reached_at']}"
    why = {"steps": "the step budget (--steps) ran out", "target": "the target was reached"}.get(
        s["stopped"], f"stopped by {s['stopped']}")
    return f"{head}; target {s['target']:g} not reached: {why}"
