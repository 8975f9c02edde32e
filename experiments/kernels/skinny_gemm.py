"""Decode-shaped GEMMs, y = x W^T (+ b) with few rows (M <= 256): a Triton candidate next to cuBLAS.

Benchmark-only (`experiments.kernels.profile --parts gemm`): the engine does not run it. Why it is worth timing:
most of a graphed decode step's time is GEMMs, and with M <= 256 each is a weight stream. cuBLAS's
tiles leave most SMs idle on the small projections (qkv and o), so they stream well below the
bandwidth the MLP's large weights reach, and the down projection runs split-K plus a separate reduce
kernel (docs/BENCHMARKS.md).

Design:
* One program per (BLOCK_M rows, BLOCK_N output columns[, K slice]). BLOCK_N is small (16-64), so
  even the 2048-column projections give 32-128 programs per row block, each streaming its own slice
  of W once along K while x (at most 256 rows) is re-read from L2.
* Split-K (SPLIT_K > 1) for long K (the down projection, K = 11008), where re-reading all of x per
  column tile would cost more L2 traffic than the weights: each program adds its partial product
  into a zeroed fp32 buffer with atomics, then one small pass adds the bias and rounds (the same
  two extra kernels cuBLAS's split-K reduce costs). Summation order then varies run to run.
* fp32 accumulation in `tl.dot` (tensor cores), bias added in fp32, one rounding to the output dtype:
  the same numerics as cuBLAS up to summation order.
* `tune_linear` times cuBLAS (`F.linear`) and each candidate config inside a CUDA graph and returns
  the fastest, so a caller only ever swaps in the kernel where it times faster; the
  `experiments.kernels.profile --parts gemm` table shows the comparison for the decode shapes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F

from rollplex.kernels.paged_attention_triton import require_triton
from rollplex.kernels.tuning import graph_time_us, round_robin

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
GEMM_CANDIDATES: tuple[tuple[int, ...], ...] = tuple(
    (64, bn, bk, 4, st, 1) for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 5)
) + ((128, 32, 128, 8, 3, 1), (128, 64, 128, 8, 3, 1)) + tuple(
    (64, bn, 128, 4, 4, sk) for bn in (32, 64, 128) for sk in (2, 4, 8)
)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [M, K], weight [N, K] (nn.Linear layout), bias [N] or None -> [M, N] in x's dtype.

    config: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]); None = F.linear (cuBLAS)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not form x @ weight.T")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} / {weight.dtype}")
    if config is None:
        return F.linear(x, weight, bias)
    if len(config) not in (5, 6) or any(int(c) < 1 for c in config) or any(c & (c - 1) for c in config[:3]):
        raise ValueError(f"config must be 5 or 6 positive ints with power-of-two blocks, got {config}")
    require_triton(x, "skinny_linear with a config")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    bm, bn, bk, warps, stages = config[:5]
    split = min(int(config[5]) if len(config) == 6 else 1, -(-K // bk))
    # split-K: partial sums meet in a zeroed fp32 buffer; the bias and the rounding come after
    y = torch.empty(M, N, device=x.device, dtype=x.dtype) if split == 1 else torch.zeros(
        M, N, device=x.device, dtype=torch.float32)
    kernel = _kernel()
    grid = (-(-N // bn), -(-M // bm), split)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        kernel[grid](
            x, weight, y if bias is None else bias, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
            -(-K // (bk * split)) * bk, HAS_BIAS=bias is not None and split == 1, ATOMIC=split > 1,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 inputs: exact, not tf32
            num_warps=warps, num_stages=stages,
        )
    if split > 1:
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    return y


def tune_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                candidates=GEMM_CANDIDATES, reps: int = 20, timer=None) -> tuple[tuple | None, dict]:
    """(fastest config or None for cuBLAS, {config: microseconds}) for these shapes on this GPU, each
    call timed as `reps` calls replayed from one CUDA graph (its cost inside a graphed decode step).
    weight may be a list of same-shaped weights (several layers'): the timed calls then cycle through
    them, so weights that fit L2 (the decode step's qkv, o and down at 8-45 MB) are read from HBM as in
    the step. Candidates the compiler rejects (e.g. out of shared memory) are skipped. timer(call, reps)
    -> microseconds replaces the graph timing (tests)."""
    weights = list(weight) if isinstance(weight, (list, tuple)) else [weight]
    times: dict = {}
    for cfg in (None, *candidates):
        call = round_robin(lambda w, cfg=cfg: skinny_linear(x, w, bias, cfg), weights)
        try:
            times[cfg] = graph_time_us(call, reps, replays=7) if timer is None else timer(call, reps)
        except Exception:  # noqa: BLE001 - a config this GPU / compiler cannot run
            continue
    best = min(times, key=times.get)
    return best, times


@functools.cache
def _kernel() -> Any:
    """Build the Triton kernel on first use, so this module imports without triton (CPU CI)."""
    import triton
    import triton.language as tl

    @triton.jit
    def linear_kernel(X, W, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                      HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        k_start = tl.program_id(2) * k_per_split  # a multiple of BLOCK_K
        k_end = tl.minimum(k_start + k_per_split, K)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + (k_start + rk)[None, :]
        w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_start + rk)[None, :]  # [BLOCK_N, BLOCK_K]: K-contiguous
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = (k0 + rk) < k_end
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        if ATOMIC:
            tl.atomic_add(y_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])
        else:
            tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return linear_kernel
