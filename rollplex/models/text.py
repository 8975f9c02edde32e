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

from .config import TextConfig
from .layers import GatedMLP, RMSNorm, apply_rotary

# attend(layer_idx, q [B, H, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]) -> out [B, H, L, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, L, D]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(self.layer_idx, q, k, v)  # [B, H, L, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False)

    def forward(self, x, cos, sin, attend: AttendFn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """x [B, L, C] embeddings; cos/sin [B, L, D] -> final-normed hidden [B, L, C]."""
        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return self.norm(x)
