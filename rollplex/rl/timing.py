"""The RL step's phase timer: wall seconds of a phase into `timing_s/<name>` (verl's names), synchronised
with the device on CUDA so that the time is the phase's own, and a span on the step's timeline; and what a
step spent compiling (`compile_metrics`): a first step, or one with new shapes, pays torch.compile's work
for the graphs it meets (more on a machine whose compile caches are empty)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from ..cosched.timeline import Timeline


@contextmanager
def phase_timer(metrics: dict, name: str, device: torch.device, timeline: Timeline | None = None):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + t1 - t0
    if timeline is not None:
        timeline.host_span("phase", name, t0, t1)


def _compile_totals() -> tuple[int, float]:
    """(graphs dynamo compiled, seconds compiling: dynamo's frames plus the backwards AOT compiles lazily, at
    their first backward) so far in this process; torch's own counters (private: zeros if they move)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0, 0.0
    secs = sum(sum(v) for k, v in compilation_time_metrics.items()
               if k == "_compile.compile_inner" or k.endswith("bw_compiler"))
    return int(counters["stats"]["unique_graphs"]), float(secs)


@contextmanager
def compile_metrics(metrics: dict):
    """On exit (an error too), `perf/compiled_graphs` and `timing_s/compile` of the block into `metrics`."""
    g0, s0 = _compile_totals()
    try:
        yield
    finally:
        g1, s1 = _compile_totals()
        metrics["perf/compiled_graphs"], metrics["timing_s/compile"] = g1 - g0, s1 - s0
