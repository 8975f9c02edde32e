"""The Triton flash-decoding kernel behind `paged_decode_attention` (see paged_attention.py).

Design of the Triton backend (flash-decoding):

* Decode is bandwidth bound: each step streams the whole KV history once and does ~1 FLOP per byte, so
  the kernel is organised around reading K/V exactly once and keeping every SM busy.
* GQA: one program per (sequence, KV head, split) computes all G = H // Hkv query heads that share the
  KV head, so a K/V tile is read from HBM once per KV head rather than once per query head. The G query
  rows are padded to >= 16 so that QK^T and PV are tensor-core ``tl.dot`` products.
* Split-K: with few sequences, B * Hkv programs cannot fill the GPU, so each sequence's tokens are cut
  into ``num_splits`` contiguous ranges of tiles handled by separate programs. Each keeps an online
  softmax in fp32 (running max m, running sum l, accumulator acc) and writes its normalised partial
  output and log-sum-exp to a workspace; a second small kernel merges the splits:
  ``out = sum_s exp(lse_s - LSE) * out_s`` with ``LSE = logsumexp_s lse_s``. With one split (large
  batches already fill the GPU) the split kernel writes the output directly and the merge is skipped.
  Given a zeroed int32 semaphore per (sequence, KV head), the merge runs inside the split kernel
  instead: each program counts itself in with an acq_rel atomic after storing its partials, and the
  last of a sequence's splits merges them and resets the count to 0 (so the buffer can serve the
  next launch, e.g. the next layer). That saves the merge kernel's launch and its ramp in every
  layer of a graphed decode step.
* CUDA graphs: seq_lens and block_table are only read on the device; each program derives its tile range
  from its sequence's length, so the grid depends only on static shapes (B, Hkv, max_blocks, block_size)
  and the launch holds no host sync. Splits with no tokens write lse = -inf; rows with seq_len 0 give 0.
* Fused cache write: given the new token's k/v (``k_new``/``v_new`` [B, Hkv, D]), the one program
  whose split covers position seq_len - 1 stores them into the cache (slot from the block table),
  then a block barrier, then the usual loop reads them like any cached token. This saves the two
  scatter kernels per layer a separate cache write costs in a graphed decode step (patching the new
  token into the loaded tiles instead breaks the load -> dot pipeline and slows the kernel). Race-free:
  no other program reads that slot, since a sequence appends only into a block it owns alone (the
  block manager forks shared partial blocks).
* Fused rotary (decode): given the new token's cos/sin [B, D], q and k_new arrive un-rotated and the
  kernel rotates them as it loads them (x * cos + rotate_half(x) * sin in fp32, rounded once to the
  cache dtype, as the compiled glue does), which saves the separate rotary kernel per layer.
* Several query rows per sequence (``ROWS`` > 1, q [B, ROWS, H, D], seq_lens [B, ROWS]): speculative
  verification scores a sequence's last token and its draft in one pass, row j seeing the first
  seq_lens[b, j] tokens. The rows join the GQA group (ROWS * G queries per program), so a sequence's
  K/V is read once for all its rows, not once per row; each score is masked by its own row's length.
  A tile may then hold no key for some row, so the online softmax guards its running max.
* Tokens are gathered per token (block id looked up for each of the TILE_N tokens of a tile), so block
  sizes 16/32/64 share one code path and table entries past a sequence's end are never dereferenced.
* TMA variant (``tile={"tma": True}``, CUDA sm_90+): a tile is one KV block (or, with a smaller
  tile_n, a part of one), fetched by the tensor memory accelerator through a 4-D descriptor over the
  cache ([1, tile_n, 1, D] boxes at [block, offset, kv_head, 0]). The row of block ids is loaded once
  before the loop, so no load feeds the loop's addresses and the software pipeliner keeps
  num_stages - 1 tiles in flight (with a load of the block id inside the loop it keeps one). The new
  token is not read back from the cache (the store is made by ordinary threads, TMA reads through
  another proxy): the loop covers the seq_len - 1 cached tokens and the owning program folds the new
  token into its online softmax from registers, its probability rounded to the cache dtype as the
  P @ V product rounds it. With 64-token blocks it is the fastest variant on the H200
  (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any

import torch

_TILE_N = 64  # tokens per inner-loop iteration; a multiple of every supported block size
_MAX_SPLITS = 64
_NUM_WARPS = 4  # default launch; 8-warp configs are tuner candidates
_NUM_STAGES = 2
_MAX_TMA_TABLE = 4096  # block ids one program holds in registers (TMA variant)
TILE_KEYS = frozenset({"tile_n", "num_warps", "num_stages", "tma"})  # the launch knobs a `tile` dict may set


def choose_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, num_sms: int = 132,
                      tile_n: int = _TILE_N) -> int:
    """Splits per sequence from static shapes only: about 4 programs per SM in all (rounded down, which
    avoids a mostly idle last wave), and at least 2 tiles per split at the table's full length."""
    max_tiles = -(-max_blocks * block_size // tile_n)
    want = 4 * num_sms // max(1, batch * num_kv_heads)
    return max(1, min(want, max_tiles // 2, _MAX_SPLITS))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def require_triton(x: torch.Tensor, what: str) -> None:
    """RuntimeError unless a Triton kernel can run on x: the triton package, and CUDA tensors (or the
    interpreter, TRITON_INTERPRET=1, for CPU tests)."""
    if not triton_available():
        raise RuntimeError(f"{what} needs the triton package")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"{what} needs CUDA tensors (or TRITON_INTERPRET=1)")


def triton_forward(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, num_splits: int | None, k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None, tile: dict | None = None, cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None, semaphore: torch.Tensor | None = None,
) -> torch.Tensor:
    if tile and not tile.keys() <= TILE_KEYS:
        raise ValueError(f"unknown tile knobs {sorted(tile.keys() - TILE_KEYS)}; known: {sorted(TILE_KEYS)}")
    require_triton(q, "backend='triton'")
    rows = 1
    if q.dim() == 4:  # several query rows per sequence (speculative verification)
        B, rows, H, D = q.shape
        if k_new is not None or cos is not None:
            raise ValueError("query rows per sequence take no new token and no rotary (write and rotate first)")
        if seq_lens.shape != (B, rows):
            raise ValueError(f"seq_lens must be [B, rows] = {(B, rows)} for q [B, rows, H, D]")
    else:
        B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    if D not in (64, 128) or block_size not in (16, 32, 64):
        raise ValueError(f"triton backend supports head_dim 64/128 and block_size 16/32/64, got {D}/{block_size}")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q / k_cache / v_cache dtypes differ: {q.dtype} / {k_cache.dtype} / {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in the head dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    has_new = k_new is not None
    if has_new:
        if k_new.dtype != k_cache.dtype or v_new.dtype != k_cache.dtype:
            raise ValueError("k_new / v_new must have the cache's dtype")
        k_new = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
        v_new = v_new if v_new.stride(-1) == 1 else v_new.contiguous()
    else:
        k_new = v_new = q  # unused (HAS_NEW=False); any tensor with two leading strides
    rotary = cos is not None
    if rotary:
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin = sin if sin.stride(-1) == 1 else sin.contiguous()
        if cos.stride(0) != sin.stride(0):
            sin = sin.contiguous()
            cos = cos.contiguous()
    else:
        cos = sin = q  # unused (ROTARY=False)
    tile = tile or {}
    tma = bool(tile.get("tma", False))
    tile_n = int(tile.get("tile_n", block_size if tma else _TILE_N))
    if tile_n < 16 or tile_n & (tile_n - 1) or (block_size % tile_n if tma else tile_n % block_size):
        raise ValueError(f"tile_n must be a power of two >= 16 and a {'divisor' if tma else 'multiple'} of "
                         f"block_size (TMA: a tile is a block or a part of one), got {tile_n}")
    block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    max_blocks = block_table.shape[1]
    if num_splits is None:
        sms = 132  # H100/H200; only used when q is not on CUDA (interpreter)
        if q.is_cuda:
            sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())
        num_splits = choose_num_splits(B, Hkv, max_blocks, block_size, sms, tile_n)
    num_splits = max(1, int(num_splits))
    G = H // Hkv
    out = torch.empty(B * rows, H, D, device=q.device, dtype=q.dtype)
    single = num_splits == 1  # the split kernel then writes `out` itself and no merge is needed
    part_out = out if single else torch.empty(B * rows, H, num_splits, D, device=q.device, dtype=torch.float32)
    part_lse = out if single else torch.empty(B * rows, H, num_splits, device=q.device, dtype=torch.float32)
    fused_merge = not single and semaphore is not None
    if fused_merge and (semaphore.dtype != torch.int32 or semaphore.numel() < B * Hkv or not semaphore.is_contiguous()):
        raise ValueError(f"semaphore must be a contiguous int32 tensor of >= B * Hkv = {B * Hkv} zeros")
    sem = semaphore if fused_merge else seq_lens  # unused unless FUSED_MERGE
    k_desc, v_desc = k_cache, v_cache  # unused unless TMA
    if tma:
        if _next_pow2(max_blocks) > _MAX_TMA_TABLE:
            raise ValueError(f"the TMA variant loads the block table row up front: at most {_MAX_TMA_TABLE} "
                             f"blocks per sequence, got {max_blocks}")
        from triton.tools.tensor_descriptor import TensorDescriptor

        box = [1, tile_n, 1, D]
        k_desc = TensorDescriptor(k_cache, list(k_cache.shape), list(k_cache.stride()), box)
        v_desc = TensorDescriptor(v_cache, list(v_cache.shape), list(v_cache.stride()), box)
    split_kernel, merge_kernel = _kernels()
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        split_kernel[(B, Hkv, num_splits)](
            q, k_cache, v_cache, k_desc, v_desc, block_table, seq_lens, part_out, part_lse, k_new, v_new, cos, sin,
            sem, out,
            scale * math.log2(math.e), q.stride(0), q.stride(-2), q.stride(1) if rows > 1 else 0, cos.stride(0),
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0), max_blocks, num_splits,
            G=G, ROWS=rows, G_PAD=max(16, _next_pow2(G * rows)), D=D, BLOCK_SIZE=block_size, TILE_N=tile_n,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # only matters for fp32: exact, not tf32
            SINGLE=single, HAS_NEW=has_new, ROTARY=rotary, FUSED_MERGE=fused_merge,
            S_PAD=_next_pow2(num_splits), TMA=tma,
            MAX_NB=_next_pow2(max_blocks) if tma else 1,
            num_warps=int(tile.get("num_warps", _NUM_WARPS)),
            num_stages=int(tile.get("num_stages", _NUM_STAGES)),
        )
        if not single and not fused_merge:
            merge_kernel[(B * rows * H,)](part_out, part_lse, out, num_splits, D=D, S_PAD=_next_pow2(num_splits),
                                          num_warps=4)
    return out.view(B, rows, H, D) if q.dim() == 4 else out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Build the Triton kernels on first use, so this module imports without triton (e.g. CPU CI)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(
        Q, K, V, KD, VD, BT, LENS, PO, PL, KN, VN, COS, SIN, SEM, OUT, scale_log2, stride_qb, stride_qh, stride_qr,
        stride_cb,
        stride_knb, stride_knh, stride_vnb, stride_vnh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb, max_blocks, num_splits,
        G: tl.constexpr, ROWS: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        PRECISION: tl.constexpr, SINGLE: tl.constexpr, HAS_NEW: tl.constexpr, ROTARY: tl.constexpr,
        FUSED_MERGE: tl.constexpr, S_PAD: tl.constexpr, TMA: tl.constexpr,
        MAX_NB: tl.constexpr,
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, TILE_N)
        g_ok = g < G * ROWS
        heads = kvh * G + g % G
        r = g // G  # the query row of each of the program's queries (0 with one row per sequence)
        cap = max_blocks * BLOCK_SIZE
        if ROWS == 1:
            seq_len = tl.minimum(tl.maximum(tl.load(LENS + b).to(tl.int32), 0), cap)
        else:  # each row its own length; the program covers the longest
            row_len = tl.load(LENS + b * ROWS + r, mask=g_ok, other=0).to(tl.int32)
            row_len = tl.minimum(tl.maximum(row_len, 0), cap)
            seq_len = tl.max(row_len, axis=0)
        num_tiles = tl.cdiv(seq_len, TILE_N)
        per_split = tl.cdiv(num_tiles, num_splits)
        t_start = split * per_split
        t_end = tl.minimum(t_start + per_split, num_tiles)
        q_rows = Q + b * stride_qb + r[:, None] * stride_qr + heads[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=g_ok[:, None], other=0.0)
        if ROTARY:  # rotate_half partner of lane d is lane (d + D/2) % D, negated in the first half
            d_rot = (d + D // 2) % D
            sign = tl.where(d < D // 2, -1.0, 1.0)
            cos = tl.load(COS + b * stride_cb + d).to(tl.float32)
            sin = tl.load(SIN + b * stride_cb + d).to(tl.float32)
            q_half = tl.load(q_rows + d_rot[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
            q = (q.to(tl.float32) * cos[None, :] + q_half * (sign * sin)[None, :]).to(q.dtype)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        l_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        bt_row = BT + b.to(tl.int64) * stride_btb
        if HAS_NEW:  # the program whose tile range holds position seq_len - 1 stores the new token first
            last = seq_len - 1
            t_last = last // TILE_N
            owns = (last >= 0) & (t_last >= t_start) & (t_last < t_end)
            w_ok = (d * 0 + owns.to(tl.int32)) > 0  # [D] (a plain scalar mask trips the interpreter)
            nblk = tl.load(bt_row + tl.maximum(last, 0) // BLOCK_SIZE).to(tl.int64)
            nslot = tl.maximum(last, 0) % BLOCK_SIZE
            kn = tl.load(KN + b * stride_knb + kvh * stride_knh + d, mask=w_ok, other=0.0)
            if ROTARY:
                kn_half = tl.load(KN + b * stride_knb + kvh * stride_knh + d_rot, mask=w_ok, other=0.0)
                kn = (kn.to(tl.float32) * cos + kn_half.to(tl.float32) * (sign * sin)).to(kn.dtype)
            vn = tl.load(VN + b * stride_vnb + kvh * stride_vnh + d, mask=w_ok, other=0.0)
            tl.store(K + nblk * stride_kb + nslot * stride_ks + kvh * stride_kh + d, kn, mask=w_ok)
            tl.store(V + nblk * stride_vb + nslot * stride_vs + kvh * stride_vh + d, vn, mask=w_ok)
            if not TMA:
                tl.debug_barrier()  # the block's later loads of that slot see the store
        if TMA:  # a tile is a block or a part of one; the cached tokens only (the new one is folded in below)
            PER_BLOCK: tl.constexpr = BLOCK_SIZE // TILE_N
            n_cached = seq_len - 1 if HAS_NEW else seq_len
            t_stop = tl.minimum(t_end, tl.cdiv(n_cached, TILE_N))  # every tile holds >= 1 cached token
            idx = tl.arange(0, MAX_NB)
            bts = tl.load(bt_row + idx, mask=(idx >= t_start // PER_BLOCK) & (idx * PER_BLOCK < t_stop), other=0)
            for t in range(t_start, t_stop):
                blk = tl.sum(tl.where(idx == t // PER_BLOCK, bts, 0))
                off = (t % PER_BLOCK) * TILE_N
                k = KD.load([blk, off, kvh, 0]).reshape(TILE_N, D)
                v = VD.load([blk, off, kvh, 0]).reshape(TILE_N, D)
                ok = t * TILE_N + n < n_cached
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
                s = tl.where(ok[None, :], s, float("-inf"))
                if ROWS > 1:
                    s = tl.where((t * TILE_N + n)[None, :] < row_len[:, None], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_use = m_new
                if ROWS > 1:  # a row may have no key up to this tile: exp2(-inf - -inf) would be NaN
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m = m_new
            if HAS_NEW:  # the owner folds the new token in: one more column of the online softmax
                s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], axis=1) * scale_log2  # [G_PAD]
                s_new = tl.where(owns, s_new, float("-inf"))
                m_new = tl.maximum(m, s_new)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_safe)
                p_new = tl.exp2(s_new - m_safe)
                l_sum = l_sum * alpha + p_new
                p_v = p_new.to(vn.dtype).to(tl.float32)  # as P @ V rounds P to the cache dtype
                acc = acc * alpha[:, None] + p_v[:, None] * vn.to(tl.float32)[None, :]
                m = m_new
        else:
            for t in range(t_start, t_end):
                pos = t * TILE_N + n
                ok = pos < seq_len
                blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
                slot = pos % BLOCK_SIZE
                k = tl.load(K + blk[:, None] * stride_kb + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                            mask=ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, TILE_N], log2 units
                s = tl.where(ok[None, :], s, float("-inf"))
                if ROWS > 1:
                    s = tl.where(pos[None, :] < row_len[:, None], s, float("-inf"))
                m_new = tl.maximum(m, tl.max(s, axis=1))
                m_use = m_new
                if ROWS > 1:  # a row may have no key up to this tile: exp2(-inf - -inf) would be NaN
                    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m - m_use)
                p = tl.exp2(s - m_use[:, None])
                l_sum = l_sum * alpha + tl.sum(p, axis=1)
                v = tl.load(V + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                            mask=ok[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m = m_new
        has = l_sum > 0.0
        lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
        o = acc / tl.where(has, l_sum, 1.0)[:, None]
        out_rows = ((b * ROWS + r) * tl.num_programs(1) * G + heads).to(tl.int64)  # rows of [B * ROWS, H]
        row = out_rows * num_splits + split  # part layout [B * ROWS, H, S, D]
        if SINGLE:  # PO is the output [B * ROWS, H, D]
            tl.store(PO + row[:, None] * D + d[None, :], o.to(PO.dtype.element_ty), mask=g_ok[:, None])
        else:
            tl.store(PL + row, lse, mask=g_ok)
            tl.store(PO + row[:, None] * D + d[None, :], o, mask=g_ok[:, None])
            if FUSED_MERGE:
                tl.debug_barrier()  # every thread's partials are stored before the count is released
                sem_ptr = SEM + b * tl.num_programs(1) + kvh
                done = tl.atomic_add(sem_ptr, 1, sem="acq_rel")
                if done == num_splits - 1:  # the last split of this (sequence, KV head): merge all
                    base = out_rows * num_splits  # [G_PAD]
                    sidx = tl.arange(0, S_PAD)
                    s_ok = g_ok[:, None] & (sidx < num_splits)[None, :]
                    lse_all = tl.load(PL + base[:, None] + sidx[None, :], mask=s_ok, other=float("-inf"),
                                      cache_modifier=".cg")  # [G_PAD, S_PAD]
                    m_all = tl.max(lse_all, axis=1)
                    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
                    denom = tl.sum(tl.exp2(lse_all - m_all[:, None]), axis=1)
                    res = tl.zeros([G_PAD, D], tl.float32)
                    for sp in range(num_splits):
                        lse_s = tl.load(PL + base + sp, mask=g_ok, other=float("-inf"), cache_modifier=".cg")
                        o_s = tl.load(PO + (base + sp)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0,
                                      cache_modifier=".cg")
                        res += tl.exp2(lse_s - m_all)[:, None] * o_s  # empty splits (lse = -inf) weigh 0
                    res = res / tl.where(denom > 0.0, denom, 1.0)[:, None]
                    tl.store(OUT + out_rows[:, None] * D + d[None, :], res.to(OUT.dtype.element_ty), mask=g_ok[:, None])
                    tl.atomic_xchg(sem_ptr, 0)  # ready for the next launch

    @triton.jit
    def merge_kernel(PO, PL, OUT, num_splits, D: tl.constexpr, S_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # b * H + h
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        s_ok = s < num_splits
        lse = tl.load(PL + row * num_splits + s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
        denom = tl.sum(w, axis=0)
        o = tl.load(PO + (row * num_splits + s)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        res = tl.sum(o * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
        tl.store(OUT + row * D + d, res.to(OUT.dtype.element_ty))

    return split_kernel, merge_kernel
