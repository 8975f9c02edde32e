"""SwiGLU fused into the gate_up GEMM: act = silu(x W_g^T) * (x W_u^T) in one Triton kernel.

Why: in the graphed decode step the gate_up GEMM (cuBLAS) writes [B, 2I] and a separate pointwise
kernel reads it back to write silu(gate) * up [B, I], once per layer; a GEMM that applies SwiGLU in
its epilogue writes only the [B, I] activation and launches one kernel less.

Design:
* gate_up_w is the model's fused [2I, K] weight (gate rows, then up rows); no re-layout. A program
  owns output columns [n, n + BLOCK_N) and loads both the gate rows n.. and the up rows I + n.. of
  the same K slice, so one x tile feeds two tensor-core dots into two fp32 accumulators.
* Numerics as the unfused path (cuBLAS GEMM, then inductor's fused SwiGLU): each accumulator is
  rounded to the weight dtype once (the GEMM's output), then silu(g) * u in fp32, rounded once.
  Only the GEMM's summation order differs.
* Grid (M blocks, N blocks) with the M blocks of one column tile adjacent, so at B = 256 the
  programs that share a weight tile run together and the second read comes from L2.
* `tune_swiglu` times cuBLAS + the pointwise kernel against each config inside a CUDA graph, cycling
  through several layers' weights, and the caller only swaps the kernel in where it times faster.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.nn.functional as F

from .paged_attention_triton import require_triton
from .tuning import graph_time_us, round_robin

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). The Triton kernel pays off at small batches,
# where the GEMM streams weights, and not at large ones, where cuBLAS's Hopper GEMM is compute-efficient
# (`python -m experiments.kernels.profile --parts swiglu`, docs/BENCHMARKS.md): the tuner decides per
# batch size.
SWIGLU_CANDIDATES: tuple[tuple[int, ...], ...] = (
    (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 128, 64, 8, 4), (128, 128, 64, 8, 3),
)


def swiglu_reference(x: torch.Tensor, gate_up_w: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
    return F.silu(gate.float()).mul(up.float()).to(x.dtype)


def check_config(config) -> None:
    """ValueError unless config is a launch config of the kernel: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages), positive ints with power-of-two blocks."""
    if (not isinstance(config, tuple) or len(config) != 5 or any(not isinstance(c, int) or c < 1 for c in config)
            or any(c & (c - 1) for c in config[:3])):
        raise ValueError(f"config must be 5 positive ints with power-of-two blocks, got {config}")


def check_candidates(candidates) -> None:
    """ValueError unless candidates is a non-empty tuple of launch configs (`check_config`)."""
    if not isinstance(candidates, tuple) or not candidates:
        raise ValueError(f"SwiGLU candidates must be a non-empty tuple of configs, got {candidates!r}")
    for c in candidates:
        check_config(c)


def swiglu_linear(x: torch.Tensor, gate_up_w: torch.Tensor, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [M, K], gate_up_w [2I, K] -> silu(x W_g^T) * (x W_u^T) [M, I] in x's dtype. config: (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages); None = cuBLAS GEMM + a pointwise SwiGLU."""
    if x.dim() != 2 or gate_up_w.dim() != 2 or x.shape[1] != gate_up_w.shape[1] or gate_up_w.shape[0] % 2:
        raise ValueError(f"x {tuple(x.shape)} and gate_up_w {tuple(gate_up_w.shape)} do not form a gated MLP input")
    if x.dtype != gate_up_w.dtype:
        raise ValueError(f"x and gate_up_w dtypes differ: {x.dtype} / {gate_up_w.dtype}")
    if config is None:
        return swiglu_reference(x, gate_up_w)
    check_config(config)
    require_triton(x, "swiglu_linear with a config")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = gate_up_w if gate_up_w.stride(-1) == 1 else gate_up_w.contiguous()
    M, K = x.shape
    inter = w.shape[0] // 2
    bm, bn, bk, warps, stages = config
    y = torch.empty(M, inter, device=x.device, dtype=x.dtype)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _kernel()[(-(-M // bm), -(-inter // bn))](
            x, w, y, M, inter, K, x.stride(0), w.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 inputs: exact, not tf32
            num_warps=warps, num_stages=stages,
        )
    return y


def tune_swiglu(x: torch.Tensor, weights: list[torch.Tensor], candidates=SWIGLU_CANDIDATES, reps: int = 20,
                timer=None, baseline=None) -> tuple[tuple | None, dict]:
    """(fastest config or None for the unfused path, {config: µs}); calls cycle through `weights`
    (several layers'), read from HBM as in the decode step. baseline(x, w): the unfused path as the
    caller runs it (the model's compiled GEMM + SwiGLU); default `swiglu_reference` (eager). Configs
    that fail to compile are skipped. timer(call, reps) -> µs replaces the graph timing (tests)."""
    baseline = baseline or swiglu_reference
    times: dict = {}
    for cfg in (None, *candidates):
        call = round_robin(lambda w, cfg=cfg: swiglu_linear(x, w, cfg) if cfg else baseline(x, w), weights)
        try:
            times[cfg] = graph_time_us(call, reps, replays=7) if timer is None else timer(call, reps)
        except Exception:  # noqa: BLE001 - a config this GPU / compiler cannot run
            continue
    return min(times, key=times.get), times


@functools.cache
def _kernel() -> Any:
    """Build the Triton kernel on first use, so this module imports without triton (CPU CI)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_kernel(X, W, Y, M, I, K, stride_xm, stride_wn, stride_ym, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < I
        x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        g_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]  # [BLOCK_N, BLOCK_K], K-contiguous
        u_ptrs = g_ptrs + I.to(tl.int64) * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        # the unfused path's GEMM output is rounded to the weight dtype; SwiGLU then runs in fp32
        g = acc_g.to(Y.dtype.element_ty).to(tl.float32)
        u = acc_u.to(Y.dtype.element_ty).to(tl.float32)
        act = g / (1.0 + tl.exp(-g)) * u
        y_ptrs = Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, act.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    return swiglu_kernel
