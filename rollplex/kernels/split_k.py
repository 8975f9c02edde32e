"""Split-K for the decode step's skinny projections, and its tuner.

`split_k_linear` cuts a GEMM along K into S slices run as one strided-batched GEMM with fp32 partials;
`add_linear_out` is how the projection's reader (the next residual add + norm) sums them where it
loads them. Whether that beats one GEMM depends on the shape and the batch size, so `tune_split_k`
times each S together with that reader.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tuning import graph_time_us, round_robin

SPLIT_K_CANDIDATES = (1, 2, 4)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T cut along K into `splits` slices -> fp32 partial products [S, M, N],
    one strided-batched GEMM. The caller sums the partials where it reads them (`add_linear_out`), so
    the split-K reduction costs no kernel of its own: for the decode step's skinny projections
    (M <= 256 rows, K = 2048 / 11008) this keeps more SMs streaming weights than one GEMM does, and
    drops cuBLAS's separate split-K reduce. Same math as F.linear: fp32 accumulation, one rounding.
    splits = 1: plain F.linear, [M, N] in x's dtype."""
    if splits == 1:
        return F.linear(x, weight)
    M, K = x.shape
    N = weight.shape[0]
    if K % splits:
        raise ValueError(f"K = {K} is not divisible by {splits} splits")
    xs = x.view(M, splits, K // splits).transpose(0, 1)  # [S, M, K/S]
    ws = weight.view(N, splits, K // splits).permute(1, 2, 0)  # [S, K/S, N], a view of the live weight
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # CPU has no bmm.dtype; fp32 models need no cast


def add_linear_out(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + a projection's output y: y [..., N] in x's dtype, or fp32 split-K partials [S, ..., N]
    (`split_k_linear`), summed and rounded to x's dtype once, as one GEMM's epilogue would."""
    if y.dim() == x.dim() + 1:
        # slice by slice, not y.sum(0): adds are pointwise, so the compiled caller fuses them into
        # its own reduction (the norm) instead of launching a separate reduction kernel over S
        acc = y[0]
        for s in range(1, y.shape[0]):
            acc = acc + y[s]
        y = acc.to(x.dtype)
    return x + y


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
