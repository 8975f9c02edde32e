"""Split-K for the decode step's skinny projections, and its tuner.

`split_k_linear` (models/layers.py) cuts a GEMM along K into S slices run as one batched GEMM with fp32
partials, which the projection's reader sums where it loads them. Whether that beats one GEMM depends
on the shape and the batch size, so `tune_split_k` times each S together with that reader.
"""

from __future__ import annotations

import torch

from ..models.layers import split_k_linear
from .tuning import graph_time_us, round_robin

SPLIT_K_CANDIDATES = (1, 2, 4)


def check_candidates(candidates) -> None:
    """ValueError unless candidates is a non-empty tuple of positive split counts."""
    if not isinstance(candidates, tuple) or not candidates or any(
            not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in candidates):
        raise ValueError(f"split-K candidates must be a non-empty tuple of positive ints, got {candidates}")


def tune_split_k(x: torch.Tensor, weights: list[torch.Tensor], consumer, candidates=SPLIT_K_CANDIDATES,
                 reps: int = 20, timer=None) -> tuple[int, dict]:
    """(fastest number of K slices for `split_k_linear(x, w, S)` (1: one F.linear GEMM), {S: µs}).

    Each candidate is timed together with what reads its output, `consumer(y)` (the decode step's
    compiled residual-add + RMSNorm, which sums split-K partials as it loads them), so S > 1 pays its
    extra fp32 read there and S = 1 pays cuBLAS's own split-K reduce if it runs one. Calls cycle
    through `weights` (several layers'), read from HBM as in the step. timer(call, reps) -> µs
    replaces the graph timing (tests)."""
    K = x.shape[1]
    times: dict = {}
    for S in candidates:
        if K % S:
            continue
        call = round_robin(lambda w, S=S: consumer(split_k_linear(x, w, S)), weights)
        times[S] = graph_time_us(call, reps, replays=7) if timer is None else timer(call, reps)
    return min(times, key=times.get), times
