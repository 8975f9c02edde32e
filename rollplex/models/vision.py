"""Qwen2.5-VL vision tower: patch embed -> window/full attention blocks -> 2x2 patch merger.

All images and video frames of a batch travel as one packed sequence of patches. Patches are
permuted once into window order (merge-unit granularity, as in the reference model), so every
attention window — and every frame, for the full-attention blocks — is a contiguous segment and a
block runs ONE varlen attention call over all of them (`attention.segment_attention`). The merger
output is permuted back to the processor's patch order, so embeddings line up with the
`<|image_pad|>` / `<|video_pad|>` tokens of the prompt.

`VisionLayout.build(grid_thw)` does the integer bookkeeping on the CPU once per forward; the
blocks only see tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Segments, _use_flash_varlen, _varlen_attn, segment_attention
from .config import VisionConfig
from .layers import GatedMLP, RMSNorm, apply_rotary, compile_fn, rms_norm, rotary_inv_freq
from .transfer import to_device


@dataclass
class VisionLayout:
    """Per-forward metadata derived from the (t, h, w) patch grids of the inputs."""

    window_index: torch.Tensor  # [n_units] merge-unit permutation into window order
    reverse_index: torch.Tensor  # inverse permutation
    hw_pos: torch.Tensor  # [n_patches, 2] (row, col) of each patch, processor order
    windows: Segments  # window segments, in permuted order
    frames: Segments  # one segment per frame (full-attention blocks)

    @classmethod
    def build(cls, grid_thw: list[tuple[int, int, int]], cfg: VisionConfig, device) -> VisionLayout:
        m = cfg.spatial_merge_size
        unit = m * m
        win = cfg.window_size // m // cfg.patch_size  # window side in merged units
        window_index, hw_pos = [], []
        cu_win, cu_frame = [0], [0]
        offset = 0
        for t, h, w in grid_thw:
            if h % m or w % m:
                raise ValueError(f"grid {(t, h, w)} not divisible by spatial_merge_size {m}")
            hpos = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            wpos = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
            hw_pos.append(torch.stack([hpos, wpos], -1).repeat(t, 1))
            lh, lw = h // m, w // m
            idx = torch.arange(t * lh * lw).reshape(t, lh, lw)
            ph, pw = -lh % win, -lw % win
            nh, nw = (lh + ph) // win, (lw + pw) // win
            idx = F.pad(idx, (0, pw, 0, ph), value=-1)
            idx = idx.reshape(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
            counts = (idx >= 0).sum(-1).flatten()
            window_index.append(idx[idx >= 0] + offset)
            for c in counts.tolist():
                if c:
                    cu_win.append(cu_win[-1] + c * unit)
            base = cu_frame[-1]
            cu_frame.extend(base + (i + 1) * h * w for i in range(t))
            offset += t * lh * lw
        window_index = torch.cat(window_index)
        return cls(
            window_index=to_device(window_index, device),
            reverse_index=to_device(torch.argsort(window_index), device),
            hw_pos=to_device(torch.cat(hw_pos), device),
            windows=Segments(cu_win, torch.device(device)),
            frames=Segments(cu_frame, torch.device(device)),
        )


def _pre_attention(x, norm_w, qkv_w, qkv_b, cos, sin, num_heads: int):
    """norm1 -> qkv -> rotary (fp32, as the reference): q, k, v [T, H, D]."""
    T = x.shape[0]
    q, k, v = F.linear(rms_norm(x, norm_w, 1e-6), qkv_w, qkv_b).view(T, 3, num_heads, -1).unbind(1)
    dtype = q.dtype
    return apply_rotary(q.float(), cos, sin).to(dtype), apply_rotary(k.float(), cos, sin).to(dtype), v


def _post_attention(x, attn, proj_w, proj_b, norm_w, gate_up_w, gate_up_b, down_w, down_b):
    """proj + residual, then norm2 -> SwiGLU -> residual."""
    x = x + F.linear(attn.flatten(1), proj_w, proj_b)
    gate, up = F.linear(rms_norm(x, norm_w, 1e-6), gate_up_w, gate_up_b).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w, down_b)


def _block_varlen(x, norm1_w, qkv_w, qkv_b, cos, sin, num_heads: int, cu, max_len: int, proj_w, proj_b, norm2_w,
                  gate_up_w, gate_up_b, down_w, down_b):
    """A whole block with flash varlen attention in one function: compiled, one graph per block call
    instead of three Python-level calls (the vision tower's small GEMMs leave the GPU waiting on the
    host otherwise)."""
    q, k, v = _pre_attention(x, norm1_w, qkv_w, qkv_b, cos, sin, num_heads)
    out = _varlen_attn(q, k, v, cu, cu, max_len, max_len)
    return _post_attention(x, out, proj_w, proj_b, norm2_w, gate_up_w, gate_up_b, down_w, down_b)


class VisionAttention(nn.Module):
    """q/k/v and the output projection; its head count is that of the weights it holds (see
    text.TextAttention)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    @property
    def num_heads(self) -> int:
        return self.qkv.weight.shape[0] // (3 * self.head_dim)


class VisionBlock(nn.Module):
    """Parameters of one block; the math lives in `_pre_attention` / `_post_attention`, plain
    functions of tensors, so one compiled graph serves every block (`VisionTower.compile`)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True)


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged_dim = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.merged_dim))))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        # Conv3d with kernel == stride is a linear map of each flattened patch; we keep the conv's
        # weight shape [E, C, T, P, P] (checkpoint compatible) and run it as one GEMM.
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", rotary_inv_freq(cfg.head_dim // 2, cfg.rope_theta), persistent=False)
        self.full_blocks = frozenset(cfg.fullatt_block_indexes)
        self.attn_backend = "auto"  # see attention.segment_attention; benchmarks flip it to compare
        self._pre, self._post, self._whole = _pre_attention, _post_attention, None

    def compile(self, **kwargs) -> VisionTower:
        """Fuse the norms, rotary and SwiGLU elementwise work with torch.compile (GPU); same math."""
        self._pre = compile_fn(_pre_attention, **kwargs)
        self._post = compile_fn(_post_attention, **kwargs)
        self._whole = compile_fn(_block_varlen, **kwargs)
        return self

    def block(self, blk: VisionBlock, x, cos, sin, seg: Segments, post=None) -> torch.Tensor:
        """One block; post: the post-attention function to run instead of the tower's own
        (`_post_attention`'s signature; ops.ForwardOps.vision_post), with the whole-block path off."""
        a, m = blk.attn, blk.mlp
        if post is None and self._whole is not None and self.attn_backend == "auto" and _use_flash_varlen(x):
            return self._whole(x, blk.norm1.weight, a.qkv.weight, a.qkv.bias, cos, sin, a.num_heads, seg.cu_tensor(),
                               seg.max_len, a.proj.weight, a.proj.bias, blk.norm2.weight, m.gate_up_proj.weight,
                               m.gate_up_proj.bias, m.down_proj.weight, m.down_proj.bias)
        q, k, v = self._pre(x, blk.norm1.weight, a.qkv.weight, a.qkv.bias, cos, sin, a.num_heads)
        out = segment_attention(q, k, v, seg, self.attn_backend)
        return (post or self._post)(x, out, a.proj.weight, a.proj.bias, blk.norm2.weight, m.gate_up_proj.weight,
                          m.gate_up_proj.bias, m.down_proj.weight, m.down_proj.bias)

    def rotary(self, layout: VisionLayout) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = layout.hw_pos[..., None].float() * self.inv_freq.float()  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # [N, D/2]: h-freqs then w-freqs
        emb = torch.cat([freqs, freqs], -1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]  # broadcast over heads

    def set_attention_backend(self, backend: str) -> None:
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"unknown vision attention backend {backend!r}")
        self.attn_backend = backend

    def permute(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        unit = self.cfg.spatial_merge_size**2
        return x.view(-1, unit, *x.shape[1:])[index].flatten(0, 1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor, post=None):
        """pixel_values [n_patches, C*T*P*P] -> merged embeddings [n_patches / merge^2, out_hidden].
        post: see `block`."""
        st = self.begin(pixel_values, grid_thw)
        for i in range(len(self.blocks)):
            self.run_block(i, st, post)
        return self.end(st)

    # the forward in pieces (a co-scheduler runs it a block at a time): begin, run_block per block, end
    def begin(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> VisionState:
        if isinstance(grid_thw, torch.Tensor):
            grid_thw = [tuple(g) for g in grid_thw.tolist()]
        n = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape != (n, self.cfg.patch_dim):
            raise ValueError(f"pixel_values shape {tuple(pixel_values.shape)} != ({n}, {self.cfg.patch_dim})")
        layout = VisionLayout.build(grid_thw, self.cfg, pixel_values.device)
        w = self.patch_embed.weight
        x = self.permute(self.patch_embed(pixel_values.to(w.dtype)), layout.window_index)
        cos, sin = (self.permute(c, layout.window_index) for c in self.rotary(layout))
        return VisionState(x, cos, sin, layout)

    def run_block(self, i: int, st: VisionState, post=None) -> None:
        seg = st.layout.frames if i in self.full_blocks else st.layout.windows
        st.x = self.block(self.blocks[i], st.x, st.cos, st.sin, seg, post)

    def end(self, st: VisionState) -> torch.Tensor:
        return self.merger(st.x)[st.layout.reverse_index]


@dataclass
class VisionState:
    """The vision tower's running state between blocks."""

    x: torch.Tensor  # [n_patches, hidden], window order
    cos: torch.Tensor
    sin: torch.Tensor
    layout: VisionLayout
