"""swiglu_linear: the Triton gate_up GEMM with SwiGLU in its epilogue against F.linear + silu * up (with
CUDA, or on CPU under TRITON_INTERPRET=1), edge tiles included; argument checks; the tuner's cycling."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import recording_timer

from rollplex.kernels.swiglu_gemm import swiglu_linear, swiglu_reference, tune_swiglu


def _runnable() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _ref(x, w):
    g, u = F.linear(x, w).chunk(2, dim=-1)
    return F.silu(g) * u


@pytest.mark.skipif(not _runnable(), reason="needs triton and CUDA (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("config", [(64, 32, 64, 4, 2), (16, 64, 32, 4, 3)])
@pytest.mark.parametrize("M,I,K", [(5, 40, 96), (70, 100, 300), (64, 64, 256)])
def test_matches_gemm_then_swiglu(config, M, I, K):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(M * I + K)
    x, w = torch.randn(M, K, generator=g).to(dev), (torch.randn(2 * I, K, generator=g) * 0.1).to(dev)
    got = swiglu_linear(x, w, config)
    assert got.shape == (M, I) and got.dtype == x.dtype
    torch.testing.assert_close(got, _ref(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not (_runnable() and torch.cuda.is_available()), reason="bf16 tl.dot needs CUDA")
def test_bf16_matches_unfused_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 2048, generator=g).cuda().bfloat16()
    w = (torch.randn(2 * 1024, 2048, generator=g) * 0.02).cuda().bfloat16()
    want = swiglu_reference(x, w).float()
    got = swiglu_linear(x, w, (128, 64, 64, 8, 4)).float()
    assert (got - want).abs().max().item() <= 2 * want.abs().max().item() * 2**-8


def test_reference_and_bad_arguments():
    x, w = torch.randn(3, 8), torch.randn(10, 8)
    torch.testing.assert_close(swiglu_linear(x, w), _ref(x, w))  # config None: GEMM + pointwise
    with pytest.raises(ValueError, match="gated MLP"):
        swiglu_linear(x, torch.randn(9, 8))
    with pytest.raises(ValueError, match="dtypes"):
        swiglu_linear(x, w.double())
    with pytest.raises(ValueError, match="config"):
        swiglu_linear(x, w, (64, 24, 64, 4, 2))


def test_tune_swiglu_cycles_through_weights():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=g)
    ws = [torch.randn(6, 8, generator=g) for _ in range(3)]
    outs = []
    timer = recording_timer(outs)
    best, times = tune_swiglu(x, ws, candidates=(), reps=4, timer=timer)
    assert best is None and times == {None: 1.0}
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, _ref(x, ws[i % 3]))
