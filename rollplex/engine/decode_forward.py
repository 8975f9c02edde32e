"""The engine's decode forward: its own layer function over the shared model's parameters.

The model (models/text.py) is plain: rotated q/k go to `attend`, each projection is one GEMM. The
decode step runs the same math differently, and that lives here, applied from outside the model
the way a parallelism plan is applied to a module it does not own:

* q and k leave the layer un-rotated: `attend(i, q, k, v, cos, sin)` is the paged-attention kernel,
  which rotates them as it loads them (one kernel per layer less);
* the projections run as a `SkinnyGemms` plan (kernels/decode_gemms.py): split-K o/down projections
  whose fp32 partials the next residual add + norm sums, and optionally gate_up with SwiGLU in the
  GEMM's epilogue.

Under tensor parallelism (`rollplex.parallel.tp`: the layers hold this rank's heads and MLP features)
`reduce` all-reduces the row-parallel o and down outputs (fp32 split-K partials included: the sum is
linear) before the residual stream reads them.

`DecodeForward` reads the model's parameters at every call (an in-place update by the trainer is
what the next step and the next graph replay see) and never writes to the model. With `compile`
it torch.compiles its own glue functions; the model and its forward stay exactly as the owner left
them, compiled or not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels.decode_gemms import SkinnyGemms
from ..kernels.split_k import add_linear_out, split_k_linear
from ..models import Qwen25VL
from ..models.layers import compile_fn, rms_norm
from ..models.text import _post_attention

# attend(layer_idx, q [B, H, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D], cos [B, L, D], sin) -> out
# [B, H, L, D], q and k not yet rotated
RotaryAttendFn = Callable[..., torch.Tensor]


def _pre_attention(x, delta, norm_w, qkv_w, qkv_b, eps: float, num_heads: int, num_kv_heads: int,
                   qk_norm_w=None):
    """residual add (x + the previous layer's MLP output `delta`, if any; fp32 split-K partials are
    summed here) -> input norm -> fused qkv [-> q/k head RMSNorm, qk_norm_w [H + Hkv, D] (Qwen3)].
    Returns un-rotated q [B, H, L, D], k/v [B, Hkv, L, D], the residual."""
    if delta is not None:
        x = add_linear_out(x, delta)
    B, L, _ = x.shape
    D = qkv_w.shape[0] // (num_heads + 2 * num_kv_heads)
    qk, v = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b).split(
        [(num_heads + num_kv_heads) * D, num_kv_heads * D], dim=-1)
    qk = qk.view(B, L, num_heads + num_kv_heads, D)
    if qk_norm_w is not None:
        qk = rms_norm(qk, qk_norm_w, eps)
    qk = qk.transpose(1, 2)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, v.view(B, L, num_kv_heads, D).transpose(1, 2), x


def _gate_up_swiglu(h, gate_up_w):
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return F.silu(gate) * up


def _residual_norm(x, y, norm_w, eps: float):
    """x + a projection's output y (or its fp32 split-K partials) -> (residual, its RMSNorm)."""
    x = add_linear_out(x, y)
    return x, rms_norm(x, norm_w, eps)


def _mlp_in(x, o_out, norm_w, gate_up_w, eps: float):
    """residual + o_proj output (or its fp32 split-K partials) -> norm -> gate_up -> SwiGLU. Returns
    (residual, activation [B, L, I]); the o and down projections run outside as `split_k_linear`."""
    x, h = _residual_norm(x, o_out, norm_w, eps)
    return x, _gate_up_swiglu(h, gate_up_w)


def _final_norm(x, delta, norm_w, eps: float):
    """The last residual add (summing split-K partials) and the final norm."""
    return rms_norm(add_linear_out(x, delta), norm_w, eps)


class DecodeForward:
    """The engine's forward for few new tokens per sequence over `model`'s parameters."""

    def __init__(self, model: Qwen25VL, compile: bool = False,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.model, self.reduce = model, reduce
        wrap = compile_fn if compile else (lambda fn: fn)
        self.pre, self.post, self.final_norm = wrap(_pre_attention), wrap(_post_attention), wrap(_final_norm)
        self.mlp_in, self.residual_norm, self.swiglu = wrap(_mlp_in), wrap(_residual_norm), wrap(_gate_up_swiglu)

    def layer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              attend: RotaryAttendFn, gemms: SkinnyGemms | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on the residual stream x + delta -> (residual after attention, this layer's MLP output:
        [B, L, C], or fp32 split-K partials [S, B, L, C] under a SkinnyGemms plan)."""
        text = self.model.model
        lyr = text.layers[i]
        a, m, eps = lyr.self_attn, lyr.mlp, text.cfg.rms_norm_eps
        q, k, v, x = self.pre(x, delta, lyr.input_layernorm.weight, a.qkv_proj.weight, a.qkv_proj.bias, eps,
                              a.num_heads, a.num_kv_heads, a.qk_norm_weight())
        out = attend(i, q, k, v, cos, sin)  # [B, H, L, D]
        if gemms is None and self.reduce is None:
            return self.post(x, out, a.o_proj.weight, lyr.post_attention_layernorm.weight, m.gate_up_proj.weight,
                             m.down_proj.weight, eps)
        gemms = gemms or SkinnyGemms()
        B, H, L, D = out.shape
        C = x.shape[-1]
        flat = out.transpose(1, 2).reshape(B * L, H * D)
        o = split_k_linear(flat, a.o_proj.weight, gemms.o_splits)  # [B*L, C] or partials [S, B*L, C]
        if self.reduce is not None:
            o = self.reduce(o)
        o = o.view(*o.shape[:-2], B, L, C)
        if gemms.gate_up_swiglu is None:
            x, act = self.mlp_in(x, o, lyr.post_attention_layernorm.weight, m.gate_up_proj.weight, eps)
            act = act.reshape(B * L, -1)
        else:
            x, h = self.residual_norm(x, o, lyr.post_attention_layernorm.weight, eps)
            act = gemms.gate_up_swiglu(h.reshape(B * L, C), m.gate_up_proj.weight)
        d = split_k_linear(act, m.down_proj.weight, gemms.down_splits)
        if self.reduce is not None:
            d = self.reduce(d)
        return x, d.view(*d.shape[:-2], B, L, C)

    def __call__(self, embeds: torch.Tensor, positions: torch.Tensor, attend: RotaryAttendFn,
                 gemms: SkinnyGemms | None = None) -> torch.Tensor:
        """embeds [B, L, C], positions [3, B, L] -> final-normed hidden [B, L, C]. attend owns K/V and
        rotates q/k; gemms: how the projections run (None: one GEMM each)."""
        text = self.model.model
        cos, sin = self.model.rope(positions, embeds.dtype)
        x, delta = embeds, None
        for i in range(len(text.layers)):
            x, delta = self.layer(i, x, delta, cos, sin, attend, gemms)
        if delta is None:
            return text.norm(x)
        return self.final_norm(x, delta, text.norm.weight, text.cfg.rms_norm_eps)
