"""Small building blocks shared by the vision tower and the text decoder.

Numerics follow transformers' Qwen2.5-VL exactly (that is what the parity tests hold us to):
RMSNorm normalises in fp32 and multiplies the weight in the input dtype; the text rotary applies
cos/sin already cast to the activation dtype, the vision rotary applies them in fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up fused in one GEMM: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.hidden, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# One compiled function serves many call shapes: prefix batches of 1 or more prompts, responses,
# decode steps (L = 1), with and without grad, for the policy and its frozen reference copy. Each
# combination is a dynamo cache entry; past the default limit (8) dynamo silently falls back to
# eager for every new one, which un-fuses training exactly where it matters.
RECOMPILE_LIMIT = 64


def compile_fn(fn, **kwargs):
    """torch.compile(fn) with automatic-dynamic shapes (dynamo's default, `dynamic=None`) and room for
    every shape/grad-mode variant we call it with.

    A size becomes symbolic only once it has changed between calls (tokens, batch); hidden size, head
    dim and head counts stay constants. With dynamic=True all of them are runtime values and the
    generated kernels' index math divides by them per element (64-bit div/mod), which makes the fused
    rotary backward several times slower and the training pass slower with it (docs/BENCHMARKS.md).
    Pass dynamic=True to compare (`--compile-dynamic true` in `experiments.kernels.profile` /
    `bench step`)."""
    import torch._dynamo.config as dcfg

    dcfg.recompile_limit = max(dcfg.recompile_limit, RECOMPILE_LIMIT)
    # The fused schedule trains (and may compile a new shape) on a worker thread while the engine
    # decodes on the caller's. torch.fx marks symbolic tracing with one process-wide flag, so while the
    # worker's compile traces its graph, a compiled call on the decode thread reads as a compiled
    # function traced by FX and raises. Nothing here FX-traces a compiled function, so such calls run
    # their compiled code as at any other time (torch without that setting runs them eagerly: the
    # same ops, rounded as eager rounds them).
    if hasattr(dcfg, "force_compile_during_fx_trace"):
        dcfg.force_compile_during_fx_trace = True
    else:
        dcfg.error_on_nested_fx_trace = False
    return torch.compile(fn, **kwargs)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, in whatever dtype the inputs have (broadcasting cos/sin)."""
    return x * cos + rotate_half(x) * sin


def rotary_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
