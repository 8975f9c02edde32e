"""Qwen2.5-VL / Qwen3 text decoder: GQA attention with M-RoPE, SwiGLU MLP, RMSNorm, pre-norm residuals.

Qwen3 differs only inside attention: no q/k/v bias and an RMSNorm over each q and k head before the
rotary (`TextConfig.qk_norm`); Qwen3-VL also adds DeepStack features to the residual stream after its
first layers at the visual token positions (`DeepStack`, given per call like the positions).

The decoder does not know where keys and values live. Each call gets an `attend(layer, q, k, v)`
callable that receives the new tokens' rotated q/k and v and returns the attention output; the
caller decides what they attend to (a causal prompt, a shared prefix plus the response, the
engine's KV cache). This is how one model definition serves the engine, the reference scorer and
the trainer without any global "current batch" state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TextConfig
from .layers import GatedMLP, RMSNorm, apply_rotary, compile_fn, rms_norm
from .ops import ForwardOps

# attend(layer_idx, q [B, H, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) -> out [B, H, L, D]; q and k
# are rotated
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DeepStack:
    """Visual features added to the residual stream after the first layers (Qwen3-VL's DeepStack).

    After layer i < len(feats), rows `index` of the flattened [B * L] residual stream get feats[i]
    ([n, C]) added: the hidden states at the visual token positions, as transformers does."""

    index: torch.Tensor  # [n] long, rows of the flattened [B * L] stream (device)
    feats: list[torch.Tensor]  # per layer [n, C]
    rows: list[int]  # `index` on the host


def _pre_attention(x, delta, norm_w, qkv_w, qkv_b, cos, sin, eps: float, num_heads: int, num_kv_heads: int,
                   qk_norm_w=None):
    """residual add (x + the previous layer's MLP output `delta`, if any) -> input norm -> fused qkv ->
    [q/k head RMSNorm, qk_norm_w [H + Hkv, D]] -> M-RoPE on q and k together (one pass). Returns
    q [B, H, L, D], k/v [B, Hkv, L, D], the residual."""
    if delta is not None:
        x = x + delta
    B, L, _ = x.shape
    D = qkv_w.shape[0] // (num_heads + 2 * num_kv_heads)
    qk, v = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b).split(
        [(num_heads + num_kv_heads) * D, num_kv_heads * D], dim=-1)
    # rotate in the GEMM's [B, L, heads, D] layout and return [B, heads, L, D] views: rotating the
    # transposed view made the compiled backward read and write across strides (~10x slower)
    qk = qk.view(B, L, num_heads + num_kv_heads, D)
    if qk_norm_w is not None:
        qk = rms_norm(qk, qk_norm_w, eps)
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
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # over the head dim, shared by all heads (HF names: q_norm, k_norm)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    @property
    def num_heads(self) -> int:
        return self.o_proj.weight.shape[1] // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return (self.qkv_proj.weight.shape[0] // self.head_dim - self.num_heads) // 2

    def qk_norm_weight(self) -> torch.Tensor | None:
        """The q and k head norms' weights as one [H + Hkv, D] (the heads this module holds), or None."""
        if not hasattr(self, "q_norm"):
            return None
        D = self.head_dim
        q, k = self.q_norm.weight.expand(self.num_heads, D), self.k_norm.weight.expand(self.num_kv_heads, D)
        return torch.cat([q, k])


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
                               a.num_kv_heads, a.qk_norm_weight())
        out = attend(i, q, k, v)  # [B, H, L, D]
        post = self._post if ops is None or ops.text_post is None else ops.text_post
        return post(x, out, a.o_proj.weight, lyr.post_attention_layernorm.weight, gate_up_w, m.down_proj.weight, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn,
                ops: ForwardOps | None = None, deepstack: DeepStack | None = None) -> torch.Tensor:
        """x [B, L, C] embeddings; cos/sin [B, L, D] -> final-normed hidden [B, L, C]. ops: see `layer`;
        deepstack: features added after the first layers (`add_deepstack`)."""
        delta = None
        for i in range(len(self.layers)):
            x, delta = self.layer(i, x, delta, cos, sin, attend, ops)
            x, delta = self.add_deepstack(i, x, delta, deepstack)
        return self.finish(x, delta)

    @staticmethod
    def add_deepstack(i: int, x: torch.Tensor, delta: torch.Tensor | None,
                      deepstack: DeepStack | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After layer i: the residual stream x + delta with deepstack.feats[i] added at its rows (the
        sum taken first, as transformers adds to the layer's output), or (x, delta) unchanged."""
        if deepstack is None or i >= len(deepstack.feats):
            return x, delta
        if delta is not None:
            x = x + delta
        f = deepstack.feats[i].to(x.dtype)
        return x.flatten(0, 1).index_add(0, deepstack.index, f).view_as(x), None

    def finish(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The final norm of the residual stream x + delta after the last layer."""
        if delta is None:
            return self.norm(x)
        return self._final(x, delta, self.norm.weight, self.cfg.rms_norm_eps)
