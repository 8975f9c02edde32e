"""skinny_linear: the Triton decode GEMM against F.linear (with CUDA, or on CPU under
TRITON_INTERPRET=1), edge tiles and split-K included; argument checks everywhere."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import recording_timer

from rollplex.bench.skinny_gemm import GEMM_CANDIDATES, skinny_linear


def _runnable() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


triton_only = pytest.mark.skipif(not _runnable(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")


@triton_only
@pytest.mark.parametrize("config", [(64, 16, 128, 4, 3), (64, 32, 64, 4, 2), (128, 64, 128, 8, 3),
                                    (64, 32, 64, 4, 2, 3), (64, 16, 128, 4, 3, 4)])  # the last two split K
@pytest.mark.parametrize("M,N,K,bias", [(5, 40, 96, True), (70, 100, 300, False), (64, 64, 256, True)])
def test_matches_f_linear(config, M, N, K, bias):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(M * N + K)
    x, w = torch.randn(M, K, generator=g).to(dev), torch.randn(N, K, generator=g).to(dev)
    b = torch.randn(N, generator=g).to(dev) if bias else None
    got, want = skinny_linear(x, w, b, config), F.linear(x, w, b)
    assert got.shape == (M, N) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not (_runnable() and torch.cuda.is_available()), reason="bf16 tl.dot needs CUDA (the "
                    "interpreter has no bf16 arithmetic)")
def test_bf16_rounds_once_from_fp32():
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 128, generator=g), torch.randn(48, 128, generator=g)
    got = skinny_linear(x.bfloat16().to(dev), w.bfloat16().to(dev), None, GEMM_CANDIDATES[0]).float().cpu()
    want = (x.bfloat16().float() @ w.bfloat16().float().T)
    assert ((got - want).abs() <= want.abs() * 2**-8 + 1e-3).all()  # within bf16 rounding of the fp32 sum


def test_bad_arguments_are_value_errors():
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match="do not form"):
        skinny_linear(x, torch.randn(6, 9))
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, torch.randn(5))
    with pytest.raises(ValueError, match="dtypes"):
        skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="config"):
        skinny_linear(x, w, None, (64, 24, 128, 4, 3))
    torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w))  # config None: cuBLAS / torch


def test_tune_linear_cycles_through_weights() -> None:
    """Given several weights, the timed calls use them round robin (each read from memory, not L2)."""
    from rollplex.bench.skinny_gemm import tune_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g)
    ws = [torch.randn(8, 16, generator=g) for _ in range(3)]
    outs = []
    timer = recording_timer(outs)
    best, times = tune_linear(x, ws, None, candidates=(), reps=4, timer=timer)
    assert best is None and times == {None: 1.0}
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, F.linear(x, ws[i % 3]))


@pytest.mark.parametrize("S", [2, 4])
def test_split_k_linear_partials_sum_to_f_linear(S) -> None:
    from rollplex.models.layers import add_linear_out, split_k_linear

    g = torch.Generator().manual_seed(S)
    x, w, res = torch.randn(6, 32, generator=g), torch.randn(10, 32, generator=g), torch.randn(6, 10, generator=g)
    parts = split_k_linear(x, w, S)
    assert parts.shape == (S, 6, 10) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(add_linear_out(res, parts), res + F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(add_linear_out(res, split_k_linear(x, w, 1)), res + F.linear(x, w))  # S=1: F.linear
    with pytest.raises(ValueError, match="divisible"):
        split_k_linear(x, w, 5)


def test_tune_split_k_times_gemm_with_its_consumer() -> None:
    """Each candidate is timed as GEMM + consumer over the weights round robin; the fastest S wins and
    S that does not divide K is skipped."""
    from rollplex.kernels.split_k import tune_split_k

    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 12, generator=g)
    ws = [torch.randn(8, 12, generator=g) for _ in range(3)]
    seen, fake_us = [], iter([2.0, 3.0, 1.0])  # candidates 1, 2, 4 (5 does not divide K = 12)

    def consumer(y):
        seen.append(y.sum(0) if y.dim() == 3 else y)
        return y

    def timer(call, reps):
        for _ in range(reps):
            call()
        return next(fake_us)

    best, times = tune_split_k(x, ws, consumer, candidates=(1, 2, 4, 5), reps=3, timer=timer)
    assert best == 4 and set(times) == {1, 2, 4}
    for i, y in enumerate(seen):
        torch.testing.assert_close(y, F.linear(x, ws[i % 3]), rtol=1e-5, atol=1e-5)
