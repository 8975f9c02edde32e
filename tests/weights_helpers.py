"""Shared helpers for the weight-sharing tests: a tiny config with uneven shapes, element-level plan
checks."""

from __future__ import annotations

from rollplex.models.config import ModelConfig, TextConfig, VisionConfig
from rollplex.weights.regions import Region
from rollplex.weights.share import ParamPlan


def tiny_cfg(vocab: int = 320) -> ModelConfig:
    """4 heads / 2 KV heads, intermediate 112, vision intermediate 48: FSDP over 3, 6 or 8 ranks gives
    uneven (padded) last shards."""
    text = TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, mrope_section=(2, 3, 3), tie_word_embeddings=False)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, window_size=56,
                          out_hidden_size=64, fullatt_block_indexes=(1,))
    return ModelConfig(text=text, vision=vision, image_token_id=300, video_token_id=301, vision_start_token_id=302,
                       vision_end_token_id=303)


def logical(region: Region, offset: int) -> tuple[int, int]:
    """(row, col) of the parameter matrix at element `offset` of the region's local tensor."""
    i, j = divmod(offset, region.width)
    key = region.row_key(i)
    assert key is not None, "offset falls in padding"
    return key[0], key[1] + j


def rect_of(region: Region, row: int) -> int:
    return max(k for k, start in enumerate(region.starts()) if start <= row)


def check_exact_cover(p: ParamPlan, train_of) -> None:
    """Every element of the rollout shard is covered exactly once by the shared window and the copies,
    and every copied / shared element is the right one. Works on rectangles, so real 7B shapes pass
    in milliseconds. train_of(rank) -> that rank's training Region."""
    s = p.rollout
    rects = []  # (row0, row1, col0, col1) in local coordinates of the rollout tensor
    if p.share is not None:
        sh = p.share
        assert sh.first % s.width == 0 and sh.numel % s.width == 0
        a, n = sh.first // s.width, sh.numel // s.width
        rects.append((a, a + n, 0, s.width))
        delta = (sh.rollout_offset - sh.train_offset) // s.width
        for i in (a, a + n - 1):  # the window is linear between rectangle starts, checked in share.py
            assert s.row_key(i) == p.train.row_key(i + delta)
        for start in s.starts() + p.train.starts():
            for i in (start, start - delta):
                if a <= i < a + n:
                    assert s.row_key(i) == p.train.row_key(i + delta)
    for c in p.copies:
        assert c.dst_pitch == s.width and c.dst_offset % s.width + c.width <= s.width
        r0, c0 = divmod(c.dst_offset, s.width)
        rects.append((r0, r0 + c.rows, c0, c0 + c.width))
        t = train_of(c.src)
        assert c.src_pitch == t.width and c.src_offset % t.width + c.width <= t.width
        for i, j in ((0, 0), (0, c.width - 1), (c.rows - 1, 0), (c.rows - 1, c.width - 1)):
            want = logical(s, c.dst_offset + i * c.dst_pitch + j)
            assert logical(t, c.src_offset + i * c.src_pitch + j) == want
        # the block's rows lie in one rectangle on each side, so matching corners means matching rows
        assert rect_of(s, r0) == rect_of(s, r0 + c.rows - 1)
        assert rect_of(t, c.src_offset // t.width) == rect_of(t, c.src_offset // t.width + c.rows - 1)
    assert sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in rects) == s.numel
    assert all(0 <= r0 < r1 <= s.rows and 0 <= c0 < c1 <= s.width for r0, r1, c0, c1 in rects)
    rects.sort()
    for k, a in enumerate(rects):
        for b in rects[k + 1 :]:
            if b[0] >= a[1]:
                break
            assert a[3] <= b[2] or b[3] <= a[2], f"overlapping pieces {a} {b}"
