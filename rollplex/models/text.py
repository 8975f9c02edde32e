"""Qwen2.5-VL text decoder: GQA attention with M-RoPE, SwiGLU MLP, RMSNorm, pre-norm residuals.

The decoder does not know where keys and values live. Each call gets an `attend(layer, q, k, v)`
callable that receives the new tokens' rotated q/k and v and returns the attention output; the
caller decides what they attend to (a causal prompt, a shared prefix plus the response, the
engine's KV cache). This is how one model definition serves the engine, the reference scorer and
the trainer without any global "current batch" state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TextConfig
from .layers import GatedMLP, RMSNorm, apply_rotary, compile_fn, rms_norm
from .ops import ForwardOps

# attend(layer_idx, q [B, H, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) -> out [B, H, L, D]; q and k
# are rotated
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pre_attention(x, delta, norm_w, qkv_w, qkv_b, cos, sin, eps: float, num_heads: int, num_kv_heads: int):
    """residual add (x + the previous layer's MLP output `delta`, if any) -> input norm -> fused qkv ->
    M-RoPE on q and k together (one pass). Returns q [B, H, L, D], k/v [B, Hkv, L, D], the residual."""
    if delta is not None:
        x = x + delta
    B, L, _ = x.shape
    D = qkv_w.shape[0] // (num_heads + 2 * num_kv_heads)
    qk, v = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b).split(
        [(num_heads + num_kv_heads) * D, num_kv_heads * D], dim=-1)
    # rotate in the GEMM's [B, L, heads, D] layout and return [B, heads, L, D] views: rotating the
    # transposed view made the compiled backward read and write across strides (~10x slower)
    qk = qk.view(B, L, num_heads + num_kv_heads, D)
    qk = apply_rotary(qk, cos[:, :, None], sin[:, :, None]).transpose(1, 2)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, v.view(B, L, num_kv_heads, D).transpose(1, 2), x


def _post_attention(x, attn, o_w, norm_w, gate_up_w, down_w, eps: float):
    """o_proj + residual, then norm -> SwiGLU. attn [B, H, L, D]. Returns (residual, MLP output): the
    second residual add happens in the next layer's `_pre_attention` (or `_final_norm`), fused with
    its norm."""
    B, H, L, D = attn.shape
    x = x + F.linear(attn.transpose(1, 2).reshape(B, L, H * D), o_w)
    gate, up = F.linear(rms_norm(x, norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return x, F.linear(F.silu(gate) * up, down_w)


def _final_norm(x, delta, norm_w, eps: float):
    return rms_norm(x + delta, norm_w, eps)


class TextAttention(nn.Module):
    """The fused q/k/v and the o projection. Its head counts are those of the weights it holds (a module
    whose parameters were replaced by a share of the heads, rollplex.parallel.tp, runs that share)."""

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        q_size, kv_size = cfg.num_attention_heads * self.head_dim, cfg.num_key_value_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=True)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)

    @property
    def num_heads(self) -> int:
        return self.o_proj.weight.shape[1] // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return (self.qkv_proj.weight.shape[0] // self.head_dim - self.num_heads) // 2


class DecoderLayer(nn.Module):
    """Parameters of one layer; the math is in `_pre_attention` / `_post_attention`, plain functions
    of tensors, so one compiled graph serves all layers (`TextDecoder.compile`)."""

    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False)


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._pre, self._post, self._final = _pre_attention, _post_attention, _final_norm

    def compile(self, **kwargs) -> TextDecoder:
        """Fuse norms, rotary, residuals and SwiGLU with torch.compile (GPU): ~4x fewer kernels per
        layer. Same math."""
        self._pre = compile_fn(_pre_attention, **kwargs)
        self._post = compile_fn(_post_attention, **kwargs)
        self._final = compile_fn(_final_norm, **kwargs)
        return self

    def layer(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, cos, sin,
              attend: AttendFn, ops: ForwardOps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i on the residual stream x + delta (delta: the previous layer's MLP output, or None)
        -> (residual after attention, this layer's MLP output). ops: the caller's steps for this call
        (`ops.text_weights`, `ops.text_post`; ops.ForwardOps), None: the decoder's own."""
        lyr = self.layers[i]
        a, m, eps = lyr.self_attn, lyr.mlp, self.cfg.rms_norm_eps
        qkv_w, qkv_b, gate_up_w = a.qkv_proj.weight, a.qkv_proj.bias, m.gate_up_proj.weight
        if ops is not None and ops.text_weights is not None:
            qkv_w, qkv_b, gate_up_w = ops.text_weights(qkv_w, qkv_b, gate_up_w)
        q, k, v, x = self._pre(x, delta, lyr.input_layernorm.weight, qkv_w, qkv_b, cos, sin, eps, a.num_heads,
                               a.num_kv_heads)
        out = attend(i, q, k, v)  # [B, H, L, D]
        post = self._post if ops is None or ops.text_post is None else ops.text_post
        return post(x, out, a.o_proj.weight, lyr.post_attention_layernorm.weight, gate_up_w, m.down_proj.weight, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                ops: ForwardOps | None = None) -> torch.Tensor:
        """x [B, L, C] embeddings; cos/sin [B, L, D] -> final-normed hidden [B, L, C]. ops: see `layer`."""
        delta = None
        for i in range(len(self.layers)):
            x, delta = self.layer(i, x, delta, cos, sin, attend, ops)
        return self.finish(x, delta)

    def finish(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the residual stream x + delta after the last layer."""
        if delta is None:
            return self.norm(x)
        return self._final(x, delta, self.norm.weight, self.cfg.rms_norm_eps)
