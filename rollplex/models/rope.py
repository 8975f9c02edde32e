"""Multimodal rotary positions (M-RoPE) for Qwen2.5-VL.

Every prompt token gets a (temporal, height, width) position triple. Text tokens use the same value
on all three axes, counting up; the tokens of an image or video take their grid coordinates offset
by the position where the visual block starts (video time is scaled by `tokens_per_second *
seconds_per_grid`). After a visual block, text continues at max(previous positions) + 1 — the
convention of the Qwen reference code, vLLM and SGLang (recent transformers releases continue at
start + max(h, w) instead; the two agree for images and for videos whose scaled time span does not
exceed the spatial span).

Generated tokens are plain text: token j of the response of a prompt of length L sits at position
L + j + delta on all axes, with delta = max(prompt positions) + 1 - L. That single integer is all
the engine and the response forward need (`PrefixState.rope_delta`).
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def mrope_positions(
    input_ids: list[int],
    cfg: ModelConfig,
    image_grid_thw: list[tuple[int, int, int]] | None = None,
    video_grid_thw: list[tuple[int, int, int]] | None = None,
    second_per_grid_ts: list[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """Return positions [3, L] (long) and the rope delta for the tokens that follow the prompt."""
    m = cfg.vision.spatial_merge_size
    images, videos = list(image_grid_thw or []), list(video_grid_thw or [])
    secs = list(second_per_grid_ts or [1.0] * len(videos))
    chunks: list[torch.Tensor] = []
    next_pos, i, n = 0, 0, len(input_ids)
    text_start = 0
    while i <= n:
        tok = input_ids[i] if i < n else None
        if tok is not None and tok not in (cfg.image_token_id, cfg.video_token_id):
            i += 1
            continue
        if i > text_start:  # flush the text run before this visual block (or the end)
            chunks.append(torch.arange(i - text_start).expand(3, -1) + next_pos)
            next_pos += i - text_start
        if tok is None:
            break
        if tok == cfg.image_token_id:
            if not images:
                raise ValueError("more image tokens in the prompt than images")
            (t, h, w), interval = images.pop(0), 1.0
        else:
            if not videos:
                raise ValueError("more video tokens in the prompt than videos")
            (t, h, w), interval = videos.pop(0), cfg.vision.tokens_per_second * secs.pop(0)
        lt, lh, lw = t, h // m, w // m
        count = lt * lh * lw
        if input_ids[i : i + count] != [tok] * count:
            raise ValueError(f"expected {count} consecutive visual tokens for grid {(t, h, w)} at {i}")
        tpos = (torch.arange(lt) * interval).long()
        grid = torch.stack(torch.meshgrid(tpos, torch.arange(lh), torch.arange(lw), indexing="ij")).reshape(3, -1)
        chunks.append(grid + next_pos)
        next_pos = int(chunks[-1].max()) + 1
        i += count
        text_start = i
    if images or videos:
        raise ValueError(f"{len(images)} images / {len(videos)} videos have no placeholder tokens in the prompt")
    pos = torch.cat(chunks, 1) if chunks else torch.zeros(3, 0, dtype=torch.long)
    return pos, next_pos - n


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, int, int], dtype: torch.dtype,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, ...] -> cos, sin [..., head_dim] in `dtype`. Frequency j comes from axis t, h or w:
    in sections (t for the first section[0], then h, then w; Qwen2.5-VL) or interleaved (Qwen3-VL:
    j = 1, 4, ... < 3 * section[1] from h, j = 2, 5, ... < 3 * section[2] from w, the rest from t)."""
    freqs = positions[..., None].float() * inv_freq.float()  # [3, ..., D/2]
    if interleaved:
        axis = mrope_axis(section, freqs.shape[-1], freqs.device)  # [D/2] in {0, 1, 2}
        freqs = torch.where(axis == 1, freqs[1], torch.where(axis == 2, freqs[2], freqs[0]))
    else:
        bands = freqs.split(list(section), dim=-1)
        freqs = torch.cat([b[i % 3] for i, b in enumerate(bands)], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_axis(section: tuple[int, int, int], half: int, device: torch.device | None = None) -> torch.Tensor:
    """The axis (0 t, 1 h, 2 w) of each of the `half` = D/2 frequencies under interleaved M-RoPE, made on
    `device` (no host-to-device copy, so a captured CUDA graph may build it)."""
    axis = torch.zeros(half, dtype=torch.long, device=device)
    axis[1 : 3 * section[1] : 3] = 1
    axis[2 : 3 * section[2] : 3] = 2
    return axis
