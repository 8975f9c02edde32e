"""What several benchmarks share: the workload builder and FLOP accounting.

The benchmark entry points (`step`, `memory`, `serve`, `parallel`, and experiments/) import from here and
never from each other, so no benchmark module depends on another's command-line program.

* workloads: `make_prompts` (image or video prompts, the step and training-profile workloads), as
  `ModelInputs`;
* FLOPs: `vit_flops` (the vision tower over a set of grids) and `update_flops` (one actor update's
  forward + backward in `serial` or `rollplex` mode), with `PEAK_TFLOPS` for MFU.
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
    """Executed FLOPs of one forward+backward over the batch in `mode` (x3 of the forward): `rollplex` and
    `serial` (packed) run each response to its own length, `serial-padded` every one to the longest."""
    t = cfg.text
    qkv = t.hidden_size * (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    layer = qkv + t.hidden_size**2 + 3 * t.hidden_size * t.intermediate_size
    linear = 2 * (t.num_hidden_layers * layer + t.hidden_size * t.vocab_size)
    attn_per_pair = 4 * t.num_hidden_layers * t.hidden_size  # QK^T + PV, per (query, key) pair
    P = len(batch.prompts[0].input_ids)
    R = batch.responses.shape[1]
    N, B = batch.num_samples, batch.num_prompts
    vis = vit_flops(cfg, grid)
    lens = [R] * N if mode == "serial-padded" else batch.response_lengths()
    if mode == "rollplex":
        prefix = B * (P * linear + attn_per_pair * P * P / 2 + vis)
        resp = sum((n - 1) * linear + attn_per_pair * (n - 1) * (P + n / 2) for n in lens)
    else:
        prefix = 0.0
        resp = sum((P + n - 1) * linear + attn_per_pair * (P + n - 1) ** 2 / 2 + vis for n in lens)
    return 3 * (prefix + resp)
