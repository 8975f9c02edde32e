"""skinny_linear (an experiment's Triton decode GEMM, experiments/kernels/skinny_gemm.py) against F.linear
(with CUDA, or on CPU under TRITON_INTERPRET=1), edge tiles and split-K included; argument checks
everywhere."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import recording_timer

from experiments.kernels.skinny_gemm import GEMM_CANDIDATES, skinny_linear


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
    from experiments.kernels.skinny_gemm import tune_linear

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, generator=g)
    ws = [torch.randn(8, 16, generator=g) for _ in range(3)]
    outs = []
    timer = recording_timer(outs)
    best, times = tune_linear(x, ws, None, candidates=(), reps=4, timer=timer)
    assert best is None and times == {None: 1.0}
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, F.linear(x, ws[i % 3]))
