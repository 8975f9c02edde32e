"""Timing kernel launch candidates the way the graphed decode step runs them.

A call inside a captured CUDA graph pays no Python or launch cost, so candidates (attention splits and
tiles, GEMM tiles) are compared as `reps` calls replayed from one graph, median of a few replays.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch


def round_robin(fn: Callable, options: Sequence) -> Callable[[], object]:
    """A call that runs fn(options[i]) for the next i on each call. Timing calls that cycle through
    several layers' weights or KV caches reads them from HBM as the decode step does; a single copy
    timed over and over stays in L2 (50 MB on the H200) and times L2."""
    count = itertools.count()
    return lambda: fn(options[next(count) % len(options)])


def graph_time_us(call, reps: int = 10, replays: int = 5) -> float:
    """Median microseconds of one call() replayed from a CUDA graph of `reps` calls (after one warm
    call on a side stream: compiles, autotunes, allocates)."""
    dev = torch.cuda.current_device()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    del g
    return sorted(times)[len(times) // 2]
