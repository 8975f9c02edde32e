"""The RL step's phase timer: wall seconds of a phase into `timing_s/<name>` (verl's names), synchronised
with the device on CUDA so that the time is the phase's own, and a span on the step's timeline."""

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
