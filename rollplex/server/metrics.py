"""Prometheus text for GET /metrics: request counters, token counters, engine/store gauges, and the
last train step's metrics as gauges (verl names sanitised: `actor/pg_loss` -> `rollplex_actor_pg_loss`,
`rollplex/prefix_dedup_ratio` -> `rollplex_prefix_dedup_ratio`). Hand-written exposition format
(no prometheus_client dependency); counters are thread-safe.
"""

from __future__ import annotations

import re
import threading
from collections import defaultdict

COUNTERS = {
    "rollplex_http_requests_total": "HTTP requests by route, method and status code.",
    "rollplex_prompt_tokens_total": "Prompt tokens of finished engine requests.",
    "rollplex_generation_tokens_total": "Generated tokens of finished engine requests.",
    "rollplex_requests_aborted_total": "Engine requests aborted (client disconnects).",
    "rollplex_rollouts_total": "Rollouts completed (for_training or not).",
    "rollplex_train_steps_total": "Successful train steps.",
    "rollplex_train_oom_total": "Train steps that ran out of device memory (answered 507).",
    "rollplex_train_nonfinite_total": "Train steps with a non-finite loss or gradient norm (answered 422).",
    "rollplex_train_steps_partial_total": "Failed train steps that had applied optimizer steps (weights changed).",
}


def sanitize(name: str) -> str:
    name = name.removeprefix("rollplex/")
    return "rollplex_" + re.sub(r"[^a-zA-Z0-9_]", "_", name).strip("_")


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                    for k, v in labels)
    return "{" + body + "}"


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple], float] = defaultdict(float)

    def inc(self, name: str, value: float = 1.0, **labels) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._counters[(name, tuple(sorted(labels.items())))] += value

    def get(self, name: str, **labels) -> float:
        with self._lock:
            if labels:
                return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)
            return sum(v for (n, _), v in self._counters.items() if n == name)

    def render(self, gauges: dict[str, float], external: dict[str, float] | None = None) -> str:
        """`external`: counters kept elsewhere (e.g. the worker's abort count), by name."""
        lines = []
        with self._lock:
            items = sorted(self._counters.items())
        items += [((name, ()), float(v)) for name, v in (external or {}).items()]
        for name, help_ in COUNTERS.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
            rows = [(labels, v) for (n, labels), v in items if n == name]
            lines += [f"{name}{_labels(labels)} {v:g}" for labels, v in rows] or [f"{name} 0"]
        named = {(k if k.startswith("rollplex_") else sanitize(k)): float(v) for k, v in gauges.items()}
        for name, value in named.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value:.10g}"]
        return "\n".join(lines) + "\n"
