"""What several benchmarks share: the W3B workload builders, FLOP accounting and the decode-state helpers.

The benchmark entry points (`model`, `rollout`, `step`, `profile`, ...) import from here and never from
each other, so no benchmark module depends on another's command-line program.

* workloads: `w3b_prompts` (the rollout bench's image prompts) and `make_prompts` (image or video
  prompts, the step and training-profile workloads), as `ModelInputs`;
* FLOPs: `vit_flops` (the vision tower over a set of grids) and `update_flops` (one actor update's
  forward + backward in `serial` or `rollplex` mode), with `PEAK_TFLOPS` for MFU;
* decode state: `set_decode_state` fills a graphed bucket's static inputs at a chosen context, and
  `gemms_str` prints the bucket's GEMM plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..models import ModelConfig, ModelInputs

if TYPE_CHECKING:
    from ..rl.batch import RolloutBatch

PEAK_TFLOPS = 989.0  # H200 dense bf16


def sync() -> None:
    """Wait for the GPU (no-op on CPU), so a wall-clock interval covers the work it launched."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def w3b_prompts(cfg: ModelConfig, n_prompts: int, size: int = 448, text: int = 96, seed: int = 0, device="cuda"):
    """`n_prompts` prompts of one size x size image between two halves of `text` random text tokens (bf16)."""
    g = torch.Generator().manual_seed(seed)
    side = size // cfg.vision.patch_size
    n_img = side * side // cfg.vision.spatial_merge_size**2
    out = []
    for _ in range(n_prompts):
        ids = torch.randint(0, 150000, (text // 2,), generator=g).tolist()
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id]
        ids += torch.randint(0, 150000, (text - text // 2 - 2,), generator=g).tolist()
        pix = torch.randn(side * side, cfg.vision.patch_dim, generator=g).to(device, torch.bfloat16)
        out.append(ModelInputs(ids, pix, torch.tensor([[1, side, side]])))
    return out


def make_prompts(cfg: ModelConfig, n_prompts: int, frames: int, size: int = 448, text: int = 96, seed: int = 0,
                 device="cuda", dtype=torch.bfloat16):
    """`n_prompts` prompts of one image (frames = 1) or one video of `frames` frames, size x size, between
    two halves of `text` random text tokens. Returns (prompts, [grid]) with the grid shared by all."""
    g = torch.Generator().manual_seed(seed)
    side = size // cfg.vision.patch_size
    t = max(1, frames // cfg.vision.temporal_patch_size)
    n_vis = t * side * side // cfg.vision.spatial_merge_size**2
    video = frames > 1
    tok = cfg.video_token_id if video else cfg.image_token_id
    out = []
    for _ in range(n_prompts):
        vocab = min(150000, cfg.image_token_id - 1)
        ids = torch.randint(0, vocab, (text // 2,), generator=g).tolist()
        ids += [cfg.vision_start_token_id] + [tok] * n_vis + [cfg.vision_end_token_id]
        ids += torch.randint(0, vocab, (text - text // 2 - 2,), generator=g).tolist()
        pix = torch.randn(t * side * side, cfg.vision.patch_dim, generator=g).to(device, dtype)
        grid = torch.tensor([[t, side, side]])
        if video:
            out.append(ModelInputs(ids, pixel_values_videos=pix, video_grid_thw=grid, second_per_grid_ts=[1.0]))
        else:
            out.append(ModelInputs(ids, pixel_values=pix, image_grid_thw=grid))
    return out, [(t, side, side)]


def vit_flops(cfg: ModelConfig, grid: list[tuple[int, int, int]]) -> float:
    """Forward FLOPs of the vision tower over the patches of `grid` (linears, window/full attention, merger;
    a Qwen3-VL tower: a two-matrix MLP, full attention in every block, the DeepStack mergers too)."""
    v = cfg.vision
    n = sum(t * h * w for t, h, w in grid)
    windows = hasattr(v, "window_size")  # Qwen2.5-VL: SwiGLU MLP (3 matrices), window attention
    layer = 4 * v.hidden_size**2 + (3 if windows else 2) * v.hidden_size * v.intermediate_size
    per_tok = 2 * (v.patch_dim * v.hidden_size + v.depth * layer)
    win = (v.window_size // v.patch_size) ** 2 if windows else 0
    frame = max(h * w for _, h, w in grid)
    full = len(v.fullatt_block_indexes) if windows else v.depth
    attn = 4 * n * v.hidden_size * (full * frame + (v.depth - full) * win)
    merged = n // v.spatial_merge_size**2
    md = v.hidden_size * v.spatial_merge_size**2
    mergers = 1 + len(getattr(v, "deepstack_visual_indexes", ()))
    return per_tok * n + attn + 2 * merged * mergers * (md * md + md * v.out_hidden_size)


def update_flops(cfg: ModelConfig, batch: RolloutBatch, mode: str, grid) -> float:
    """Executed FLOPs of one forward+backward over the batch in `mode` (x3 of the forward)."""
    t = cfg.text
    qkv = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    layer = qkv + t.hidden_size**2 + 3 * t.hidden_size * t.intermediate_size
    linear = 2 * (t.num_hidden_layers * layer + t.hidden_size * t.vocab_size)
    attn_per_pair = 4 * t.num_hidden_layers * t.hidden_size  # QK^T + PV, per (query, key) pair
    P = len(batch.prompts[0].input_ids)
    R = batch.responses.shape[1]
    N, B = batch.num_samples, batch.num_prompts
    vis = vit_flops(cfg, grid)
    if mode == "rollplex":
        prefix = B * (P * linear + attn_per_pair * P * P / 2 + vis)
        resp = N * ((R - 1) * linear + attn_per_pair * (R - 1) * (P + R / 2))
    else:
        L = P + R - 1
        prefix, resp = 0.0, N * (L * linear + attn_per_pair * L * L / 2 + vis)
    return 3 * (prefix + resp)


def set_decode_state(runner, B: int, ctx: int, seed: int = 0) -> None:
    """Fill the runner's static decode inputs for B sequences that each hold `ctx` cached tokens in
    their own blocks (blocks 1.. are handed out in order; block 0 is scratch)."""
    bs = runner.block_size
    per = -(-ctx // bs)
    if 1 + B * per > runner.num_blocks:
        raise ValueError(f"{B} x {ctx} tokens do not fit {runner.num_blocks} KV blocks")
    g = torch.Generator().manual_seed(seed)
    table = 1 + torch.arange(B * per).view(B, per)
    meta = torch.stack([torch.randint(0, 150000, (B,), generator=g), torch.full((B,), ctx - 1),
                        torch.full((B,), ctx), table[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs])
    runner.static_meta[:, :B].copy_(meta)
    runner.static_bt[:B].zero_()
    runner.static_bt[:B, :per].copy_(table.to(torch.int32))


def gemms_str(g) -> str:
    """A graphed bucket's SkinnyGemms in one line (the fused SwiGLU as its Triton config)."""
    if g is None:
        return "None"
    sw = getattr(g.gate_up_swiglu, "keywords", {}).get("config") if g.gate_up_swiglu else None
    return f"o_splits={g.o_splits} down_splits={g.down_splits} swiglu={sw}"
