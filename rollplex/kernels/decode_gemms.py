"""Which kernels run the graphed decode step's projections, chosen per batch-size bucket by timing.

The model's `SkinnyGemms` says how an inference forward runs its projections (same math, up to fp32
summation order): split-K o/down projections whose fp32 partials the next residual-add + norm sums,
and optionally a fused gate_up + SwiGLU kernel. Which choice is faster depends on the batch size (on
the H200: split-K helps the down projection at every B and the o projection at B <= 64; the Triton
SwiGLU GEMM wins at B <= 64 and loses from 128 on, docs/BENCHMARKS.md), so the runner times the
candidates for each graphed bucket on the model's own weights before capturing it:

* each candidate runs as in the step, together with what reads its output (the compiled residual-add
  + norm for the split-K partials; the compiled GEMM + SwiGLU is the fused kernel's baseline);
* the timed calls cycle through several layers' live weights, so they are read from HBM, not L2.
"""

from __future__ import annotations

import functools

import torch

from ..models import Qwen25VL, SkinnyGemms
from .paged_attention_triton import triton_available
from .split_k import SPLIT_K_CANDIDATES, tune_split_k
from .swiglu_gemm import SWIGLU_CANDIDATES, swiglu_linear, tune_swiglu


def tune_decode_gemms(model: Qwen25VL, b: int, split_k: tuple[int, int] | None, fused_swiglu: bool,
                      layers: int = 8, split_k_candidates: tuple[int, ...] | None = None,
                      swiglu_candidates: tuple[tuple[int, ...], ...] | None = None) -> tuple[SkinnyGemms, dict]:
    """(SkinnyGemms for batch size b, the tuner's timings {name: {candidate: µs}}). split_k: a fixed
    (S_o, S_down) instead of timing; fused_swiglu: whether the Triton SwiGLU GEMM is a candidate.
    split_k_candidates / swiglu_candidates: what is timed (None: SPLIT_K_CANDIDATES / SWIGLU_CANDIDATES)."""
    text, tcfg = model.model, model.cfg.text
    dev, dt = text.embed_tokens.weight.device, text.embed_tokens.weight.dtype
    lyrs = text.layers[:layers]
    C, eps = tcfg.hidden_size, tcfg.rms_norm_eps
    times: dict = {}
    if split_k is None:
        res = torch.randn(b, 1, C, device=dev, dtype=dt)

        def consumer(y):  # y: [b, C] or partials [S, b, C] -> the next residual add + norm
            return text._final(res, y.view(*y.shape[:-2], b, 1, C), text.norm.weight, eps)

        picks = []
        for name, K, ws in (("o", C, [lyr.self_attn.o_proj.weight for lyr in lyrs]),
                            ("down", tcfg.intermediate_size, [lyr.mlp.down_proj.weight for lyr in lyrs])):
            x = torch.randn(b, K, device=dev, dtype=dt) * 0.1
            best, us = tune_split_k(x, ws, consumer, split_k_candidates or SPLIT_K_CANDIDATES)
            picks.append(best)
            times[name] = {k: round(v, 2) for k, v in us.items()}
        split_k = tuple(picks)
    swiglu = None
    if fused_swiglu and dev.type == "cuda" and triton_available():
        h = torch.randn(b, C, device=dev, dtype=dt)
        best, us = tune_swiglu(h, [lyr.mlp.gate_up_proj.weight for lyr in lyrs],
                               swiglu_candidates or SWIGLU_CANDIDATES, baseline=text._swiglu)
        times["swiglu"] = {str(k): round(v, 2) for k, v in us.items()}
        if best is not None:
            swiglu = functools.partial(swiglu_linear, config=best)
    return SkinnyGemms(split_k[0], split_k[1], swiglu), times
