"""Which kernels run the graphed decode step's projections, chosen per batch-size bucket by timing.

`SkinnyGemms` says how the engine's decode layer runs its projections (same math, up to fp32
summation order): split-K o/down projections whose fp32 partials the next residual-add + norm sums,
and optionally a fused gate_up + SwiGLU kernel. Which choice is faster depends on the batch size
(split-K pays off where few rows leave SMs idle; the Triton SwiGLU GEMM wins while the GEMM streams
weights and loses once cuBLAS's GEMM is compute-efficient; docs/BENCHMARKS.md), so the runner times
the candidates for each graphed bucket on the model's own weights before capturing it:

* each candidate runs as in the step, together with what reads its output (the step's residual-add
  + norm for the split-K partials; the step's GEMM + SwiGLU is the fused kernel's baseline);
* the timed calls cycle through several layers' live weights, so they are read from HBM, not L2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models import Qwen25VL
from .paged_attention_triton import triton_available
from .split_k import SPLIT_K_CANDIDATES, tune_split_k
from .swiglu_gemm import SWIGLU_CANDIDATES, swiglu_linear, tune_swiglu


@dataclass(frozen=True)
class SkinnyGemms:
    """How a forward with few tokens (the engine's graphed decode) runs its projections; the math is
    the same, up to fp32 summation order.

    o_splits / down_splits: the o and down projections run as `split_k.split_k_linear` with that many K
    slices (1: a plain GEMM); the down projection's partials [S, B, L, C] are what the layer returns as
    its MLP output, and the next layer's residual add sums them. gate_up_swiglu: a kernel computing
    silu(h W_g^T) * (h W_u^T) from h [M, K] and the fused [2I, K] weight (e.g. `swiglu_linear` with a
    config); None: a GEMM, then SwiGLU in the compiled glue."""

    o_splits: int = 1
    down_splits: int = 1
    gate_up_swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if self.o_splits < 1 or self.down_splits < 1:
            raise ValueError(f"split counts must be >= 1, got {self.o_splits} / {self.down_splits}")


def tune_decode_gemms(model: Qwen25VL, b: int, split_k: tuple[int, int] | None, fused_swiglu: bool,
                      residual_norm: Callable, swiglu: Callable, layers: int = 8,
                      split_k_candidates: tuple[int, ...] | None = None,
                      swiglu_candidates: tuple[tuple[int, ...], ...] | None = None) -> tuple[SkinnyGemms, dict]:
    """(SkinnyGemms for batch size b, the tuner's timings {name: {candidate: µs}}). split_k: a fixed
    (S_o, S_down) instead of timing; fused_swiglu: whether the Triton SwiGLU GEMM is a candidate.
    residual_norm(x, y, norm_w, eps) and swiglu(h, gate_up_w): the step's own reader of a projection's
    output (summing split-K partials) and its unfused gate_up GEMM + SwiGLU, as the step runs them.
    split_k_candidates / swiglu_candidates: what is timed (None: SPLIT_K_CANDIDATES / SWIGLU_CANDIDATES)."""
    text, tcfg = model.model, model.cfg.text
    dev, dt = text.embed_tokens.weight.device, text.embed_tokens.weight.dtype
    lyrs = text.layers[:layers]
    C, eps = tcfg.hidden_size, tcfg.rms_norm_eps
    times: dict = {}
    if split_k is None:
        res = torch.randn(b, 1, C, device=dev, dtype=dt)

        def consumer(y):  # y: [b, C] or partials [S, b, C] -> the next residual add + norm
            return residual_norm(res, y.view(*y.shape[:-2], b, 1, C), text.norm.weight, eps)

        picks = []
        for name, ws in (("o", [lyr.self_attn.o_proj.weight for lyr in lyrs]),
                         ("down", [lyr.mlp.down_proj.weight for lyr in lyrs])):
            x = torch.randn(b, ws[0].shape[1], device=dev, dtype=dt) * 0.1  # in-features: a TP shard's own
            best, us = tune_split_k(x, ws, consumer, split_k_candidates or SPLIT_K_CANDIDATES)
            picks.append(best)
            times[name] = {k: round(v, 2) for k, v in us.items()}
        split_k = tuple(picks)
    fused = None
    if fused_swiglu and dev.type == "cuda" and triton_available():
        h = torch.randn(b, C, device=dev, dtype=dt)
        best, us = tune_swiglu(h, [lyr.mlp.gate_up_proj.weight for lyr in lyrs],
                               swiglu_candidates or SWIGLU_CANDIDATES, baseline=swiglu)
        times["swiglu"] = {str(k): round(v, 2) for k, v in us.items()}
        if best is not None:
            fused = functools.partial(swiglu_linear, config=best)
    return SkinnyGemms(split_k[0], split_k[1], fused), times
