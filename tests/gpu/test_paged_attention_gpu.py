"""GPU checks of the Triton paged decode attention (skipped without CUDA): bf16 at serving-like shapes
against the torch reference, and capture/replay in a CUDA graph with new seq_lens / block tables; the
verification variant (several query rows per sequence) in bf16 with the gather and TMA loops."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import _verify_case, make_case

from rollplex.kernels.paged_attention import paged_decode_attention, paged_verify_attention

pytestmark = pytest.mark.gpu

B, H, HKV, D = 64, 16, 2, 128


def _random_lens(seed: int, block_size: int, n: int = B, hi: int = 1000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, hi + 1, (n,), generator=g).tolist()
    lens[:4] = [1, block_size, block_size + 1, hi]
    return lens


@pytest.mark.parametrize("block_size", [16, 32])
def test_bf16_matches_reference(block_size: int) -> None:
    case = make_case(_random_lens(0, block_size), H, HKV, D, block_size, dtype=torch.bfloat16, device="cuda")
    out = paged_decode_attention(*case)  # auto -> triton on CUDA
    ref = paged_decode_attention(*case, backend="reference")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    for num_splits in (1, 7):
        out = paged_decode_attention(*case, backend="triton", num_splits=num_splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_zero_length_rows(dtype: torch.dtype) -> None:
    lens = _random_lens(1, 64, n=8, hi=300) + [0]
    case = make_case(lens, 8, 1, 64, 64, dtype=dtype, device="cuda", seed=1, pad_value=-1)
    out = paged_decode_attention(*case, backend="triton")
    ref = paged_decode_attention(*case, backend="reference")
    tol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)
    assert torch.all(out[-1] == 0)


def test_cuda_graph_capture_and_replay() -> None:
    block_size, max_len = 16, 1024
    max_blocks = max_len // block_size
    num_blocks = B * max_blocks + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, HKV, D, device="cuda", generator=g).bfloat16()
    q = torch.zeros(B, H, D, device="cuda", dtype=torch.bfloat16)
    table = torch.zeros(B, max_blocks, device="cuda", dtype=torch.int32)
    lens = torch.ones(B, device="cuda", dtype=torch.int32)

    def fill(seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q.copy_(torch.randn(B, H, D, device="cuda", generator=gen))
        lens.copy_(torch.randint(1, max_len + 1, (B,), device="cuda", generator=gen))
        perm = torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: B * max_blocks] + 1
        table.copy_(perm.view(B, max_blocks).int())

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        paged_decode_attention(q, k_cache, v_cache, table, lens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, k_cache, v_cache, table, lens)
    for seed in (1, 2, 3):
        fill(seed)
        graph.replay()
        ref = paged_decode_attention(q, k_cache, v_cache, table, lens, backend="reference")
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_in_kernel_merge_and_rotary_in_a_graph(num_splits: int) -> None:
    """The engine's launch: un-rotated q/k_new (strided views of one qkv tensor), cos/sin, a shared
    semaphore, the new token written, many splits racing to be last; 20 replays of a graph holding 4
    back-to-back launches (layers) must each equal the reference and leave the semaphore zeroed."""
    from rollplex.models.layers import apply_rotary

    block_size = 16
    lens = _random_lens(4, block_size, hi=900)
    _, k_cache, v_cache, table, seq_lens = make_case(lens, H, HKV, D, block_size, dtype=torch.bfloat16,
                                                      device="cuda", seed=4, pad_value=0)
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(B, H + 2 * HKV, D, device="cuda", generator=gen).bfloat16()
    ang = torch.rand(B, D // 2, device="cuda", generator=gen) * 500
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    sem = torch.zeros(B * HKV, dtype=torch.int32, device="cuda")
    q, k_new, v_new = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(4)]

    def step():
        return [paged_decode_attention(q, kc, vc, table, seq_lens, num_splits=num_splits, k_new=k_new, v_new=v_new,
                                       cos=cos, sin=sin, semaphore=sem) for kc, vc in caches]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    kr, vr = k_cache.clone(), v_cache.clone()
    rq = apply_rotary(q.float(), cos.float()[:, None], sin.float()[:, None]).bfloat16()
    rk = apply_rotary(k_new.float(), cos.float()[:, None], sin.float()[:, None]).bfloat16()
    ref = paged_decode_attention(rq, kr, vr, table, seq_lens, backend="reference", k_new=rk, v_new=v_new)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert not sem.any()
        for out, (kc, vc) in zip(outs, caches):
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
            assert torch.equal(vc, vr)  # the new k may differ from the reference's by an FMA's last bit
            torch.testing.assert_close(kc.float(), kr.float(), atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("tile", [{}, {"tile_n": 128, "num_warps": 8}, {"tma": True, "num_stages": 3}])
def test_verify_rows_bf16_match_reference(tile: dict) -> None:
    """Five query rows per sequence (a token and a 4-token draft) at Qwen2.5-VL-3B's heads, in bf16."""
    if tile.get("tma") and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90")
    case = _verify_case(_random_lens(4, 64, n=24), 5, H, HKV, D, 64, device="cuda", seed=4)
    q, k, v, table, lens = case
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = paged_verify_attention(q, k, v, table.clamp(min=0), lens, backend="reference").float()
    for num_splits in (None, 1, 5):
        sem = torch.zeros(24 * HKV, dtype=torch.int32, device="cuda")
        out = paged_verify_attention(q, k, v, table.clamp(min=0), lens, backend="triton", num_splits=num_splits,
                                     tile=tile, semaphore=sem)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
