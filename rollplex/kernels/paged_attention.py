"""Paged-KV decode attention: one new query token per sequence against a block-paged KV cache.

Token i of sequence b lives at ``cache[block_table[b, i // block_size], i % block_size]``.

Backends: ``triton`` (flash-decoding, `paged_attention_triton.py`, which also stores the new token's
K/V) on CUDA, and ``reference`` — plain torch, any device/dtype — the test oracle and the CPU path.
`tune_decode` times launch configurations of the Triton kernel; the engine runs it per graphed
batch size at capture.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch

from ..models.layers import apply_rotary
from .paged_attention_triton import TILE_KEYS, choose_num_splits, triton_available, triton_forward
from .tuning import graph_time_us, round_robin

log = logging.getLogger(__name__)

__all__ = ["DECODE_CANDIDATES", "attn_variant", "check_candidates", "choose_num_splits", "fits",
           "paged_decode_attention", "paged_verify_attention", "tune_decode"]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    *,
    num_splits: int | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tile: dict | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    semaphore: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, D] over the first seq_lens[b] cached tokens of each sequence -> [B, H, D].

    k_new / v_new [B, Hkv, D]: the new token of each sequence (position seq_len - 1); it is written
    into the cache at that position (slot from block_table) and attended to. tile: Triton launch
    knobs for tuning (tile_n, num_warps, num_stages, tma).
    cos / sin [B, D]: q and k_new are un-rotated and get the rotary embedding of their token first
    (`x * cos + rotate_half(x) * sin`), inside the kernel on the Triton backend.
    semaphore: an int32 buffer of >= B * Hkv zeros that the caller keeps (Triton, split launches: the
    last split of each sequence merges inside the kernel and leaves the buffer zeroed; without it a
    second kernel merges)."""
    B, H, D = q.shape
    num_blocks, block_size, Hkv, Dk = k_cache.shape
    if v_cache.shape != k_cache.shape or Dk != D:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if H % Hkv != 0:
        raise ValueError(f"num query heads {H} is not a multiple of num KV heads {Hkv}")
    if block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("block_table must be [B, max_blocks] and seq_lens [B]")
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new come together")
    if k_new is not None and (k_new.shape != (B, Hkv, D) or v_new.shape != (B, Hkv, D)):
        raise ValueError(f"k_new / v_new must be [B, Hkv, D] = {(B, Hkv, D)}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin come together")
    if cos is not None and (cos.shape != (B, D) or sin.shape != (B, D)):
        raise ValueError(f"cos / sin must be [B, D] = {(B, D)}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if backend == "auto":
        fits = q.shape[-1] in (64, 128) and k_cache.shape[1] in (16, 32, 64)
        backend = "triton" if q.is_cuda and fits and triton_available() else "reference"
    if backend == "reference":
        if cos is not None:
            q = apply_rotary(q, cos[:, None], sin[:, None])
            k_new = None if k_new is None else apply_rotary(k_new, cos[:, None], sin[:, None])
        if k_new is not None:
            _write_new(k_cache, v_cache, block_table, seq_lens, k_new, v_new)
        return _reference(q, k_cache, v_cache, block_table, seq_lens, scale)
    if backend == "triton":
        return triton_forward(q, k_cache, v_cache, block_table, seq_lens, scale, num_splits, k_new, v_new, tile,
                              cos, sin, semaphore)
    raise ValueError(f"unknown backend {backend!r}: expected 'auto', 'triton' or 'reference'")


def paged_verify_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, backend: str = "auto", *,
                           num_splits: int | None = None, tile: dict | None = None,
                           semaphore: torch.Tensor | None = None) -> torch.Tensor:
    """Several query rows per sequence, q [B, R, H, D] (speculative verification: a sequence's last token
    and its draft, their K/V already in the cache and rotated): row j of sequence b attends to its first
    seq_lens[b, j] cached tokens -> [B, R, H, D]. The Triton backend reads each sequence's K/V once for
    all its rows (rows as query heads of the GQA group); the reference treats each row as a sequence."""
    B, R, H, D = q.shape
    if block_table.shape[0] != B or seq_lens.shape != (B, R):
        raise ValueError(f"block_table must be [B, max_blocks] and seq_lens [B, R] = {(B, R)} for q {tuple(q.shape)}")
    if backend == "auto":
        fits_kernel = D in (64, 128) and k_cache.shape[1] in (16, 32, 64)
        backend = "triton" if q.is_cuda and fits_kernel and triton_available() else "reference"
    if backend == "triton":
        scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
        return triton_forward(q, k_cache, v_cache, block_table, seq_lens, scale, num_splits, tile=tile,
                              semaphore=semaphore)
    if backend != "reference":
        raise ValueError(f"unknown backend {backend!r}: expected 'auto', 'triton' or 'reference'")
    out = paged_decode_attention(q.reshape(B * R, H, D), k_cache, v_cache, block_table.repeat_interleave(R, 0),
                                 seq_lens.reshape(B * R), scale, "reference")
    return out.view(B, R, H, D)


# (num_splits, tile) candidates the engine times per graphed batch size (EngineConfig.attn_candidates
# replaces them); None = choose_num_splits. The gather kernel's configs cover its tile sizes, stage
# counts and fixed split counts; with KV read from HBM, as in the step, further gather configs time
# within noise of these, so they would only lengthen capture. The TMA variant (sm_90+; one block, or a
# part of one, per tile) is the fastest attention with 64-token blocks on the H200; which stage count,
# split count and tile size wins depends on the batch size, so those are timed (docs/BENCHMARKS.md).
# Candidates that do not fit the cache (a gather tile_n below block_size) or the GPU (TMA before
# sm_90) are left out at tuning time (`fits`).
DECODE_CANDIDATES = (
    (None, {}),
    (1, {"tile_n": 32}),
    (1, {"tile_n": 128, "num_warps": 8, "num_stages": 3}),
    (1, {"num_stages": 3}),
    (2, {}),
    (4, {}),
    (None, {"tma": True, "num_stages": 3}),
    (1, {"tma": True, "num_stages": 2}),
    (1, {"tma": True, "num_stages": 3}),
    (2, {"tma": True, "num_stages": 2}),
    (2, {"tma": True, "num_stages": 3}),
    (1, {"tma": True, "num_stages": 3, "tile_n": 32}),
)


def check_candidates(candidates) -> None:
    """ValueError unless candidates is a non-empty tuple of (num_splits, tile) launch configs:
    num_splits None (chosen from the shapes) or a positive int; tile a dict of Triton launch knobs,
    tile_n and num_warps powers of two, num_stages a positive int, tma a bool."""
    if not isinstance(candidates, tuple) or not candidates:
        raise ValueError(f"attention candidates must be a non-empty tuple of (num_splits, tile), got {candidates!r}")
    for cand in candidates:
        if not isinstance(cand, tuple) or len(cand) != 2 or not isinstance(cand[1], dict):
            raise ValueError(f"an attention candidate is (num_splits, tile dict), got {cand!r}")
        splits, tile = cand
        if splits is not None and (not isinstance(splits, int) or isinstance(splits, bool) or splits < 1):
            raise ValueError(f"num_splits must be None or a positive int, got {splits!r}")
        if not tile.keys() <= TILE_KEYS:
            raise ValueError(f"unknown tile knobs {sorted(tile.keys() - TILE_KEYS)}; known: {sorted(TILE_KEYS)}")
        for key in ("tile_n", "num_warps", "num_stages"):
            v = tile.get(key, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or (key != "num_stages" and v & (v - 1)):
                raise ValueError(f"tile {key} must be a positive int{'' if key == 'num_stages' else ' power of two'}, "
                                 f"got {v!r}")
        if not isinstance(tile.get("tma", False), bool):
            raise ValueError(f"tile tma must be a bool, got {tile['tma']!r}")


def attn_variant(tile: dict | None) -> str:
    """Which kernel a launch config runs: 'gather' (pointer loads) or 'tma'."""
    return "tma" if (tile or {}).get("tma") else "gather"


def fits(tile: dict, block_size: int, device: torch.device) -> bool:
    """Whether a launch config applies to this cache and GPU at all (not a failure to report)."""
    if tile.get("tma"):
        return block_size % int(tile.get("tile_n", block_size)) == 0 and (
            device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9)
    return int(tile.get("tile_n", 64)) % block_size == 0


def tune_decode(q, k_cache, v_cache, block_table, seq_lens, k_new, v_new, candidates=DECODE_CANDIDATES,
                reps: int = 10, cos=None, sin=None, semaphore=None, timer=graph_time_us,
                check_rows: int = 8, backend: str = "auto") -> tuple[int | None, dict]:
    """The fastest (num_splits, tile) for these shapes on this GPU, each timed as `reps` calls replayed
    from one CUDA graph (`timer`: what a call costs inside the graphed decode step). Writes k_new/v_new
    into the cache, so run it before the cache holds sequences.

    k_cache / v_cache may be lists (e.g. several layers' caches): the timed calls then cycle through
    them, so each call reads KV that is not in L2, as in the decode step (one layer's KV at B = 64 fits
    the L2 of an H200: timed on one cache, a config looks faster than it runs in the step).

    A candidate is only timed once its output on the first `check_rows` sequences matches the reference
    backend's; one that fails to compile or launch (e.g. more shared memory than a smaller GPU has) or
    disagrees is skipped with a warning. RuntimeError if none is left."""
    call_kw = dict(k_new=k_new, v_new=v_new, cos=cos, sin=sin)
    ks = list(k_cache) if isinstance(k_cache, (list, tuple)) else [k_cache]
    vs = list(v_cache) if isinstance(v_cache, (list, tuple)) else [v_cache]
    if len(ks) != len(vs) or not ks:
        raise ValueError("k_cache and v_cache must be tensors or equally long non-empty lists")
    kvs = list(zip(ks, vs))
    k_cache, v_cache = kvs[0]
    r = slice(0, check_rows)
    ref = paged_decode_attention(q[r], k_cache, v_cache, block_table[r], seq_lens[r], backend="reference",
                                 k_new=k_new[r], v_new=v_new[r], cos=None if cos is None else cos[r],
                                 sin=None if sin is None else sin[r]).float()
    tol = 1e-4 if q.dtype == torch.float32 else 2e-2
    best, best_us, rejected = None, float("inf"), []
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        for num_splits, tile in candidates:
            if not fits(tile, k_cache.shape[1], q.device):
                continue
            def attend(kv, num_splits=num_splits, tile=tile):  # kv: one (k_cache, v_cache) pair
                return paged_decode_attention(q, kv[0], kv[1], block_table, seq_lens, num_splits=num_splits,
                                              tile=tile, semaphore=semaphore, backend=backend, **call_kw)

            try:
                err = (attend(kvs[0])[r].float() - ref).abs().max().item()
                if not err <= tol:
                    raise ValueError(f"output differs from the reference by {err:.3g}")
                us = timer(round_robin(attend, kvs), reps)
            except Exception as e:  # noqa: BLE001 - any failing candidate is skipped, not fatal
                rejected.append(((num_splits, tile), f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            if us < best_us:
                best, best_us = (num_splits, tile), us
    for cand, why in rejected:
        log.warning("paged attention candidate %s skipped: %s", cand, why)
    if best is None:
        raise RuntimeError(f"no paged-attention launch config works here: {rejected}")
    return best


def _write_new(k_cache, v_cache, block_table, seq_lens, k_new, v_new) -> None:
    """Store each sequence's new token at position seq_len - 1 (rows with seq_len 0 write nothing)."""
    block_size = k_cache.shape[1]
    last = seq_lens.long() - 1
    rows = torch.nonzero(last >= 0).squeeze(-1)
    blk = block_table.long()[rows, last[rows] // block_size]
    k_cache[blk, last[rows] % block_size] = k_new[rows]
    v_cache[blk, last[rows] % block_size] = v_new[rows]


def _reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    B, H, D = q.shape
    num_blocks, block_size, Hkv, _ = k_cache.shape
    table = block_table.long()
    table = torch.where((table >= 0) & (table < num_blocks), table, 0)
    T = table.shape[1] * block_size
    k = k_cache[table].reshape(B, T, Hkv, D).float()  # [B, T, Hkv, D]
    v = v_cache[table].reshape(B, T, Hkv, D).float()
    qg = q.float().reshape(B, Hkv, H // Hkv, D)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale
    valid = torch.arange(T, device=q.device)[None, :] < seq_lens.to(q.device).long()[:, None]  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(valid.any(dim=1)[:, None, None, None], p, 0.0)  # seq_len 0: all -inf -> NaN -> 0
    out = torch.einsum("bkgt,btkd->bkgd", p, v)
    return out.reshape(B, H, D).to(q.dtype)
