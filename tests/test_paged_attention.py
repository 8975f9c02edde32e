"""paged_decode_attention: the torch reference against per-sequence dense SDPA (always, on CPU), and the
Triton kernel against the reference (with CUDA, or on CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from rollplex.kernels.paged_attention import choose_num_splits, paged_decode_attention, paged_verify_attention


def make_case(
    lens: list[int], H: int, Hkv: int, D: int, block_size: int, dtype: torch.dtype = torch.float32,
    device: str = "cpu", seed: int = 0, pad_value: int = -1, extra_cols: int = 1,
) -> tuple[torch.Tensor, ...]:
    """Random q and caches; each sequence gets its blocks from a shuffled pool (non-contiguous tables)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(need) + extra_cols
    table = torch.full((len(lens), max_blocks), pad_value, dtype=torch.int32)
    i = 0
    for b, nb in enumerate(need):
        table[b, :nb] = torch.tensor(perm[i : i + nb], dtype=torch.int32)
        i += nb
    q = torch.randn(len(lens), H, D, generator=g)
    k = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    v = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q.to(dtype), k.to(dtype), v.to(dtype), table, seq_lens))


def naive(q, k_cache, v_cache, table, seq_lens, scale=None) -> torch.Tensor:
    """Dense SDPA per sequence over its gathered tokens (fp32)."""
    B, H, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        idx = torch.arange(n, device=q.device)
        blocks = table[b].long()[idx // block_size]
        k = k_cache[blocks, idx % block_size].float().repeat_interleave(H // Hkv, dim=1)  # [n, H, D]
        v = v_cache[blocks, idx % block_size].float().repeat_interleave(H // Hkv, dim=1)
        o = F.scaled_dot_product_attention(q[b].float()[:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale)
        out[b] = o[:, 0]
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (16, 2)])
def test_reference_matches_dense_sdpa(block_size: int, H: int, Hkv: int) -> None:
    lens = [1, block_size, block_size + 1, 3 * block_size + 5, 300, 0]
    case = make_case(lens, H, Hkv, 64, block_size, pad_value=-1 if H != Hkv else 0)
    out = paged_decode_attention(*case, backend="reference")
    assert out.shape == case[0].shape and out.dtype == case[0].dtype
    torch.testing.assert_close(out, naive(*case), atol=1e-5, rtol=1e-5)
    assert torch.all(out[-1] == 0)  # seq_len 0 -> zeros


def test_reference_scale_dtype_and_auto_backend() -> None:
    case = make_case([5, 40, 17], 8, 2, 128, 16, dtype=torch.bfloat16, seed=1)
    out = paged_decode_attention(*case, scale=0.3)  # auto -> reference on CPU
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), naive(*case, scale=0.3), atol=2e-2, rtol=0)


def test_rejects_bad_shapes() -> None:
    q, k, v, table, lens = make_case([3, 4], 6, 4, 64, 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q, k, v, table, lens)
    with pytest.raises(ValueError, match="backend"):
        paged_decode_attention(q[:, :4], k, v, table, lens, backend="cuda")


def test_unknown_launch_knobs_are_rejected() -> None:
    q, k, v, table, lens = make_case([3, 4], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="unknown tile knobs"):
        paged_decode_attention(q, k, v, table, lens, backend="triton", tile={"early_v": True})


def test_choose_num_splits_uses_static_shapes() -> None:
    assert choose_num_splits(64, 2, 64, 16, num_sms=132) == 4  # 128 programs x 4 splits ~ 4 per SM
    assert choose_num_splits(8, 2, 500, 16, num_sms=132) == 33
    assert choose_num_splits(1, 2, 2048, 16, num_sms=132) == 64  # capped
    assert choose_num_splits(64, 2, 14, 16, num_sms=132) == 2  # >= 2 tiles of 64 tokens per split
    assert choose_num_splits(1, 1, 1, 16) == 1
    assert choose_num_splits(4096, 8, 100, 16) == 1


def _triton_runnable() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    )


triton_only = pytest.mark.skipif(not _triton_runnable(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")


@triton_only
@pytest.mark.parametrize("num_splits", [None, 1, 3, 8])
def test_triton_matches_reference(num_splits: int | None) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [70, 1, 16, 0] if num_splits in (1, 8) else [70, 17, 33]  # a seq_len-0 row; 8 splits: many empty
    case = make_case(lens, 4, 2, 64, 16, device=device, seed=2)
    out = paged_decode_attention(*case, backend="triton", num_splits=num_splits)
    ref = paged_decode_attention(*case, backend="reference")
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(out).all()


@triton_only
@pytest.mark.parametrize(
    "H,Hkv,D,block_size,dtype",
    [
        (8, 1, 128, 32, torch.float32),
        (2, 2, 64, 64, torch.float32),
        (16, 2, 128, 16, torch.float16),
        (16, 2, 128, 16, torch.bfloat16),
    ],
)
def test_triton_shapes_and_dtypes(H: int, Hkv: int, D: int, block_size: int, dtype: torch.dtype) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter's tl.dot computes garbage for bf16 operands (numpy has no bf16)")
    lens = [block_size, block_size + 1, 130, 1]
    case = make_case(lens, H, Hkv, D, block_size, dtype=dtype, device=device, seed=3, pad_value=0)
    out = paged_decode_attention(*case, backend="triton", num_splits=2)
    ref = paged_decode_attention(*case, backend="reference")
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)


def _with_new_token(case, seed: int = 5):
    q, k, v, table, lens = case
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D = q.shape[0], k.shape[2], k.shape[3]
    k_new = torch.randn(B, Hkv, D, generator=g).to(k.dtype).to(k.device)
    v_new = torch.randn(B, Hkv, D, generator=g).to(k.dtype).to(k.device)
    return k_new, v_new


def test_reference_new_token_is_written_then_attended() -> None:
    case = make_case([5, 16, 17, 40], 4, 2, 64, 16, seed=4, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    k2, v2 = k.clone(), v.clone()
    out = paged_decode_attention(q, k2, v2, table, lens, backend="reference", k_new=k_new, v_new=v_new)
    for b, n in enumerate(lens.tolist()):  # the slot of position n-1, from the table
        blk, off = int(table[b, (n - 1) // 16]), (n - 1) % 16
        torch.testing.assert_close(k2[blk, off], k_new[b])
        torch.testing.assert_close(v2[blk, off], v_new[b])
    torch.testing.assert_close(out, naive(q, k2, v2, table, lens))
    with pytest.raises(ValueError, match="together"):
        paged_decode_attention(q, k, v, table, lens, k_new=k_new)


@triton_only
@pytest.mark.parametrize("num_splits,tile", [(None, None), (1, {"tile_n": 32}), (3, {"tile_n": 128, "num_warps": 8}),
                                             (8, {"num_stages": 3}), (1, {"tma": True}),
                                             (3, {"tma": True, "num_stages": 3}), (8, {"tma": True})])
def test_triton_fused_new_token_write(num_splits, tile) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case([70, 1, 16, 33, 64, 65], 4, 2, 64, 16, device=device, seed=6, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    kr, vr, kt, vt = k.clone(), v.clone(), k.clone(), v.clone()
    ref = paged_decode_attention(q, kr, vr, table, lens, backend="reference", k_new=k_new, v_new=v_new)
    out = paged_decode_attention(q, kt, vt, table, lens, backend="triton", num_splits=num_splits, k_new=k_new,
                                 v_new=v_new, tile=tile)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(kt, kr) and torch.equal(vt, vr)  # the same slots written, nothing else touched


def _rotary(B: int, D: int, seed: int = 7, device: str = "cpu", dtype=torch.float32):
    """cos/sin [B, D] as the model builds them (each half repeated), for arbitrary positions."""
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(B, D // 2, generator=g) * 100.0
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().to(device, dtype), ang.sin().to(device, dtype)


def test_reference_rotary_equals_rotating_first() -> None:
    from rollplex.models.layers import apply_rotary

    case = make_case([5, 16, 17, 40], 8, 2, 64, 16, seed=8, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    cos, sin = _rotary(4, 64)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    fused = paged_decode_attention(q, k1, v1, table, lens, backend="reference", k_new=k_new, v_new=v_new,
                                   cos=cos, sin=sin)
    rq, rk = apply_rotary(q, cos[:, None], sin[:, None]), apply_rotary(k_new, cos[:, None], sin[:, None])
    first = paged_decode_attention(rq, k2, v2, table, lens, backend="reference", k_new=rk, v_new=v_new)
    assert torch.equal(fused, first) and torch.equal(k1, k2) and torch.equal(v1, v2)
    with pytest.raises(ValueError, match="together"):
        paged_decode_attention(q, k, v, table, lens, cos=cos)
    with pytest.raises(ValueError, match=r"\[B, D\]"):
        paged_decode_attention(q, k, v, table, lens, cos=cos[:, :32], sin=sin[:, :32])


@triton_only
@pytest.mark.parametrize("num_splits,tile", [(1, None), (3, None), (1, {"tma": True}), (3, {"tma": True})])
def test_triton_fused_rotary(num_splits, tile) -> None:
    """The engine's call: q / k_new / v_new are strided views into one fused qkv output, un-rotated."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    H, Hkv, D = 8, 2, 64
    case = make_case([70, 1, 16, 33], H, Hkv, D, 16, device=device, seed=9, pad_value=0)
    _, k, v, table, lens = case
    g = torch.Generator().manual_seed(10)
    qkv = torch.randn(4, H + 2 * Hkv, D, generator=g).to(device)
    q, k_new, v_new = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
    cos, sin = _rotary(4, D, device=device)
    kr, vr, kt, vt = k.clone(), v.clone(), k.clone(), v.clone()
    ref = paged_decode_attention(q, kr, vr, table, lens, backend="reference", k_new=k_new, v_new=v_new,
                                 cos=cos, sin=sin)
    out = paged_decode_attention(q, kt, vt, table, lens, backend="triton", num_splits=num_splits, k_new=k_new,
                                 v_new=v_new, cos=cos, sin=sin, tile=tile)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kt, kr, atol=1e-5, rtol=1e-5)
    assert torch.equal(vt, vr)


@triton_only
@pytest.mark.parametrize("num_splits,tile", [(2, None), (3, None), (8, None), (3, {"tma": True})])
def test_triton_in_kernel_merge(num_splits, tile) -> None:
    """With a semaphore the last split merges inside the kernel: same output as the merge kernel, and
    the semaphore is zero again afterwards, so back-to-back launches (layers) can share it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case([70, 1, 16, 0, 200], 8, 2, 64, 16, device=device, seed=11, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    sem = torch.zeros(5 * 2 + 3, dtype=torch.int32, device=device)
    ref = paged_decode_attention(q, k.clone(), v.clone(), table, lens, backend="reference", k_new=k_new, v_new=v_new)
    for _ in range(2):
        kt, vt = k.clone(), v.clone()
        out = paged_decode_attention(q, kt, vt, table, lens, backend="triton", num_splits=num_splits, k_new=k_new,
                                     v_new=v_new, semaphore=sem, tile=tile)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert not sem.any()
    with pytest.raises(ValueError, match="semaphore"):
        paged_decode_attention(q, k, v, table, lens, backend="triton", num_splits=2, semaphore=sem[:3])


@triton_only
def test_tune_decode_skips_failing_candidates_and_picks_the_fastest(caplog) -> None:
    from rollplex.kernels.paged_attention import tune_decode

    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case([40, 17, 64, 5], 8, 2, 64, 16, device=device, seed=12, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    cos, sin = _rotary(4, 64, device=device)
    sem = torch.zeros(8, dtype=torch.int32, device=device)
    fake_us = iter([5.0, 3.0, 4.0])  # one number per candidate that gets timed, in order
    cands = ((1, {}), (2, {"tile_n": 48}), (2, {}), (4, {"tile_n": 32}))  # tile_n 48: ValueError
    best = tune_decode(q, k, v, table, lens, k_new, v_new, candidates=cands, cos=cos, sin=sin, semaphore=sem,
                       timer=lambda call, reps: next(fake_us), check_rows=2, backend="triton")
    assert best == (2, {})
    assert "tile_n" in caplog.text and "skipped" in caplog.text
    with pytest.raises(RuntimeError, match="no paged-attention launch config"):
        tune_decode(q, k, v, table, lens, k_new, v_new, candidates=((2, {"tile_n": 48}),), timer=lambda c, r: 1.0,
                    backend="triton")


def test_tune_decode_times_calls_that_cycle_through_caches() -> None:
    """With lists of caches (several layers), each timed call reads the next cache: the tuner measures
    KV that comes from memory, not from a cache that the previous call left in L2."""
    from rollplex.kernels.paged_attention import tune_decode

    case = make_case([40, 17, 64, 5], 8, 2, 64, 16, seed=13, pad_value=0)
    q, k, v, table, lens = case
    k_new, v_new = _with_new_token(case)
    ks, vs = [k.clone() for _ in range(3)], [v.clone() for _ in range(3)]
    seen = []

    def timer(call, reps):
        for _ in range(reps):
            out = call()
            seen.append(out)
        return 1.0

    best = tune_decode(q, ks, vs, table, lens, k_new, v_new, candidates=((None, {}),), timer=timer, reps=3,
                       backend="reference")
    assert best == (None, {})
    slot = lambda b: (table[b, (lens[b] - 1) // 16].item(), (lens[b] - 1).item() % 16)  # noqa: E731
    for kc, vc in zip(ks, vs):  # every cache got the new token written by one of the calls
        for b in range(4):
            blk, s = slot(b)
            assert torch.equal(kc[blk, s], k_new[b]) and torch.equal(vc[blk, s], v_new[b])
    torch.testing.assert_close(seen[0], seen[1])
    torch.testing.assert_close(seen[1], seen[2])
    with pytest.raises(ValueError, match="equally long"):
        tune_decode(q, ks, vs[:2], table, lens, k_new, v_new, candidates=((None, {}),), timer=timer,
                    backend="reference")


@triton_only
@pytest.mark.parametrize("block_size,num_splits,new_token",
                         [(16, 1, False), (32, 2, True), (64, 1, True), (64, 5, True), (32, 5, False),
                          (64, 1, "half"), (64, 3, "quarter")])
def test_triton_tma_variant(block_size, num_splits, new_token) -> None:
    """TMA loads, one block per tile: lengths on and next to block boundaries, a length-1 row (only the new
    token) and a length-0 row; the new token folded in from registers gives the reference's output and the
    same cache contents."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lens = [block_size, block_size + 1, 3 * block_size - 1, 1, 0, 2 * block_size + 7]
    case = make_case(lens, 8, 2, 64, block_size, device=device, seed=13, pad_value=0)
    q, k, v, table, lens_t = case
    tile = {"tma": True, "num_stages": 3}
    if new_token in ("half", "quarter"):  # tiles that are parts of a block
        tile["tile_n"] = block_size // (2 if new_token == "half" else 4)
    kw = dict(zip(("k_new", "v_new"), _with_new_token(case))) if new_token else {}
    sem = torch.zeros(len(lens) * 2, dtype=torch.int32, device=device)
    kr, vr, kt, vt = k.clone(), v.clone(), k.clone(), v.clone()
    ref = paged_decode_attention(q, kr, vr, table, lens_t, backend="reference", **kw)
    out = paged_decode_attention(q, kt, vt, table, lens_t, backend="triton", num_splits=num_splits,
                                 tile=tile, semaphore=sem, **kw)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(kt, kr) and torch.equal(vt, vr) and not sem.any()


def test_launch_configs_that_do_not_apply_are_left_out() -> None:
    """fits(): a TMA tile must be a block or a part of one (and TMA needs sm_90+ on CUDA); a gather tile
    must cover whole blocks. attn_variant() names the kernel a config runs."""
    from rollplex.kernels.paged_attention import DECODE_CANDIDATES, attn_variant, fits

    cpu = torch.device("cpu")
    assert fits({"tma": True, "tile_n": 32}, 64, cpu) and not fits({"tma": True, "tile_n": 64}, 32, cpu)
    assert fits({"tile_n": 64}, 16, cpu) and not fits({"tile_n": 32}, 64, cpu)
    assert {attn_variant(t) for _, t in DECODE_CANDIDATES} == {"gather", "tma"} and attn_variant(None) == "gather"


def _verify_case(lens: list[int], rows: int, H: int, Hkv: int, D: int, block_size: int, device: str = "cpu",
                 seed: int = 0):
    """A case for paged_verify_attention: sequence b's rows see lens[b] - rows + 1 .. lens[b] tokens (a
    sequence's last token and its draft), except sequence 0's last row, a padding row of length 1."""
    q, k, v, table, last = make_case(lens, H, Hkv, D, block_size, device=device, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    qr = torch.randn(len(lens), rows, H, D, generator=g).to(device)
    seq_lens = (last.long()[:, None] - rows + 1 + torch.arange(rows, device=last.device)).clamp(min=0)
    seq_lens[0, -1] = 1
    return qr, k, v, table, seq_lens.to(torch.int32)


def test_verify_rows_equal_one_decode_row_each() -> None:
    """Row j of a sequence in paged_verify_attention == a decode query over that sequence's first
    seq_lens[b, j] tokens (dense SDPA per row)."""
    q, k, v, table, lens = _verify_case([70, 17, 33, 5], 5, 4, 2, 64, 16)
    out = paged_verify_attention(q, k, v, table, lens, backend="reference")
    B, R, H, D = q.shape
    for j in range(R):
        torch.testing.assert_close(out[:, j], naive(q[:, j], k, v, table, lens[:, j]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="seq_lens \\[B, R\\]"):
        paged_verify_attention(q, k, v, table, lens[:, 0], backend="reference")


@triton_only
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("tile", [{}, {"tile_n": 32}])
def test_triton_verify_rows_match_reference(num_splits: int | None, tile: dict) -> None:
    """The Triton kernel with the rows in the GQA group (K/V read once per sequence) equals the per-row
    reference, also where a split or tile holds no key for some row (the padding row of length 1)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = _verify_case([70, 17, 40, 33], 5, 4, 2, 64, 16, device=device, seed=3)
    out = paged_verify_attention(*case, backend="triton", num_splits=num_splits, tile=tile)
    ref = paged_verify_attention(*case, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    sem = torch.zeros(8, dtype=torch.int32, device=device)
    fused = paged_verify_attention(*case, backend="triton", num_splits=num_splits or 3, tile=tile, semaphore=sem)
    torch.testing.assert_close(fused, ref, rtol=1e-4, atol=1e-4)
    assert int(sem.abs().sum()) == 0
