"""Qwen3-VL vision tower: patch embed + interpolated learned positions -> full-attention blocks ->
2x2 patch merger, plus DeepStack mergers.

All images and video frames of a batch travel as one packed sequence of patches in the processor's
order (merge-block order: each 2x2 merge unit contiguous). Every block attends within each frame (no
windows), as one varlen call over all frames (`attention.segment_attention`). The learned position
table is a square of `grid_side`^2 embeddings, bilinearly resampled (align_corners) to each grid:
4 taps and weights per patch, computed on the host once per forward like the rest of the layout.

DeepStack: after the blocks in `deepstack_visual_indexes`, the hidden states go through mergers of
their own (LayerNorm over the merged 4 patches). The tower returns one row per merged token:
[merged features | DeepStack feature 0 | 1 | ...], [n, C * (1 + K)], so whoever keeps a prompt's
visual features (`ModelInputs.vision_embeds`) keeps its DeepStack features with them.

The tower runs as begin / run_block per block / end (what a co-scheduler interleaves) and each block
goes through `block(blk, ...)` (the slot activation checkpointing and FSDP wrap), as vision.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Segments, segment_attention
from .config3 import Qwen3VisionConfig
from .layers import apply_rotary, compile_fn, rotary_inv_freq
from .transfer import to_device


@dataclass
class Vision3Layout:
    """Per-forward metadata of the (t, h, w) patch grids, processor order."""

    hw_pos: torch.Tensor  # [n_patches, 2] (row, col) of each patch
    pos_index: torch.Tensor  # [n_patches, 4] rows of the position table (bilinear taps)
    pos_weight: torch.Tensor  # [n_patches, 4] their weights
    frames: Segments  # one attention segment per frame

    @classmethod
    def build(cls, grid_thw: list[tuple[int, int, int]], cfg: Qwen3VisionConfig, device) -> Vision3Layout:
        m, side = cfg.spatial_merge_size, cfg.grid_side
        hw_pos, index, weight, cu = [], [], [], [0]
        for t, h, w in grid_thw:
            if h % m or w % m:
                raise ValueError(f"grid {(t, h, w)} not divisible by spatial_merge_size {m}")
            # (row, col) of the patches in merge-block order: (h/m, w/m, m, m)
            rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            (hi, hw_), (wi, ww) = _taps(rows, h, side), _taps(cols, w, side)
            index.append((hi[:, :, None] * side + wi[:, None, :]).reshape(-1, 4).repeat(t, 1))
            weight.append((hw_[:, :, None] * ww[:, None, :]).reshape(-1, 4).repeat(t, 1))
            hw_pos.append(torch.stack([rows, cols], -1).repeat(t, 1))
            base = cu[-1]
            cu.extend(base + (i + 1) * h * w for i in range(t))  # one segment per frame
        return cls(to_device(torch.cat(hw_pos), device), to_device(torch.cat(index), device),
                   to_device(torch.cat(weight), device), Segments(cu, torch.device(device)))


def _taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps [n, 2] into a `side`-long axis for positions `index` of an axis
    of length `size`, and their weights [n, 2] (fp32), as transformers resamples the table."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps, weights


def _pre_attention(x, n1_w, n1_b, qkv_w, qkv_b, cos, sin, num_heads: int):
    """norm1 -> qkv -> 2D rotary (fp32, as the reference): q, k, v [T, H, D]."""
    T = x.shape[0]
    h = F.layer_norm(x, x.shape[-1:], n1_w, n1_b, 1e-6)
    q, k, v = F.linear(h, qkv_w, qkv_b).view(T, 3, num_heads, -1).unbind(1)
    dtype = q.dtype
    return apply_rotary(q.float(), cos, sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype), v


def _post_attention(x, attn, proj_w, proj_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b, approximate: str):
    """proj + residual, then norm2 -> GELU MLP -> residual."""
    x = x + F.linear(attn.flatten(1), proj_w, proj_b)
    h = F.layer_norm(x, x.shape[-1:], n2_w, n2_b, 1e-6)
    return x + F.linear(F.gelu(F.linear(h, fc1_w, fc1_b), approximate=approximate), fc2_w, fc2_b)


def tensor_parallel_post(reduce):
    """`_post_attention` over a rank's shards (heads of proj's input, fc1's output features): the
    row-parallel proj and fc2 outputs are summed over the ranks by `reduce`, then their (whole) biases
    added, before they join the residual stream."""

    def post(x, attn, proj_w, proj_b, n2_w, n2_b, fc1_w, fc1_b, fc2_w, fc2_b, approximate: str):
        x = x + reduce(F.linear(attn.flatten(1), proj_w)) + proj_b
        h = F.layer_norm(x, x.shape[-1:], n2_w, n2_b, 1e-6)
        return x + reduce(F.linear(F.gelu(F.linear(h, fc1_w, fc1_b), approximate=approximate), fc2_w)) + fc2_b

    return post


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    @property
    def num_heads(self) -> int:
        return self.qkv.weight.shape[0] // (3 * self.head_dim)


class VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)


class VisionBlock(nn.Module):
    """Parameters of one block (HF names); the math is `_pre_attention` / `_post_attention`."""

    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)


class PatchMerger(nn.Module):
    """LayerNorm (per patch, or over the 4 merged patches for DeepStack) -> fc1 -> GELU -> fc2."""

    def __init__(self, cfg: Qwen3VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim) if self.postshuffle_norm else x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


@dataclass
class Vision3State:
    """The tower's running state between blocks."""

    x: torch.Tensor  # [n_patches, hidden]
    cos: torch.Tensor
    sin: torch.Tensor
    layout: Vision3Layout
    deepstack: list[torch.Tensor] = field(default_factory=list)  # merged [n_tokens, C] per DeepStack block


class Qwen3VisionTower(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig):
        super().__init__()
        self.cfg = cfg
        # the Conv3d (kernel == stride) as one GEMM over flattened patches; checkpoints keep the conv shape
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes)
        self.deepstack_at = {b: i for i, b in enumerate(cfg.deepstack_visual_indexes)}
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.head_dim // 2, cfg.rope_theta), persistent=False)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        self.attn_backend = "auto"
        self._pre, self._post = _pre_attention, _post_attention

    def compile(self, **kwargs) -> Qwen3VisionTower:
        """Fuse the norms, rotary and MLP elementwise work with torch.compile (GPU); same math."""
        self._pre = compile_fn(_pre_attention, **kwargs)
        self._post = compile_fn(_post_attention, **kwargs)
        return self

    def set_attention_backend(self, backend: str) -> None:
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"unknown vision attention backend {backend!r}")
        self.attn_backend = backend

    def block(self, blk: VisionBlock, x, cos, sin, seg: Segments, post=None) -> torch.Tensor:
        """One block; post: the post-attention function to run instead of the tower's own (its
        signature: `_post_attention`'s; `tensor_parallel_post` over a rank's shards)."""
        a, m = blk.attn, blk.mlp
        q, k, v = self._pre(x, blk.norm1.weight, blk.norm1.bias, a.qkv.weight, a.qkv.bias, cos, sin, a.num_heads)
        out = segment_attention(q, k, v, seg, self.attn_backend)
        return (post or self._post)(x, out, a.proj.weight, a.proj.bias, blk.norm2.weight, blk.norm2.bias,
                                    m.linear_fc1.weight, m.linear_fc1.bias, m.linear_fc2.weight, m.linear_fc2.bias,
                                    self.approximate)

    def rotary(self, layout: Vision3Layout) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = layout.hw_pos[..., None].float() * self.inv_freq.float()  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # [N, D/2]: h-freqs then w-freqs
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]  # broadcast over heads

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor, post=None):
        """pixel_values [n_patches, C*T*P*P] -> [n_patches / merge^2, out_hidden * (1 + DeepStack blocks)]."""
        st = self.begin(pixel_values, grid_thw)
        for i in range(len(self.blocks)):
            self.run_block(i, st, post)
        return self.end(st)

    def begin(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> Vision3State:
        if isinstance(grid_thw, torch.Tensor):
            grid_thw = [tuple(g) for g in grid_thw.tolist()]
        n = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (n, self.cfg.patch_dim):
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != ({n}, {self.cfg.patch_dim})")
        layout = Vision3Layout.build(grid_thw, self.cfg, pixel_values.device)
        w = self.patch_embed.weight
        x = self.patch_embed(pixel_values.to(w.dtype))
        pos = (self.pos_embed(layout.pos_index) * layout.pos_weight[:, :, None]).sum(1)  # [N, hidden], fp32 weights
        cos, sin = self.rotary(layout)
        return Vision3State(x + pos.to(x.dtype), cos, sin, layout)

    def run_block(self, i: int, st: Vision3State, post=None) -> None:
        st.x = self.block(self.blocks[i], st.x, st.cos, st.sin, st.layout.frames, post)
        if i in self.deepstack_at:
            st.deepstack.append(self.deepstack_merger_list[self.deepstack_at[i]](st.x))

    def end(self, st: Vision3State) -> torch.Tensor:
        return torch.cat([self.merger(st.x), *st.deepstack], dim=-1)
