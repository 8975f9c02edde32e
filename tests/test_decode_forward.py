"""The engine's decode forward (engine/decode_forward.py) over the model's parameters computes the model's
own forward: with q/k rotated inside `attend` (as the paged-attention kernel does) and under the
projection plans the engine tunes per bucket (split-K o/down, SwiGLU in a GEMM epilogue)."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from rollplex.engine.decode_forward import DecodeForward
from rollplex.kernels.decode_gemms import SkinnyGemms
from rollplex.kernels.swiglu_gemm import swiglu_linear, swiglu_reference
from rollplex.models import load_model
from rollplex.models.attention import sdpa
from rollplex.models.layers import apply_rotary


def _triton_runnable() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _inputs(model, dev, B=3, L=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, model.cfg.text.hidden_size, generator=g).to(dev)
    pos = (torch.arange(L)[None, None] + torch.tensor([0, 4, 9])[None, :B, None]).expand(3, B, L).to(dev)
    return x, pos


def _attend(i, q, k, v):
    return sdpa(q, k, v, causal=True)


def _attend_rotating(i, q, k, v, cos, sin):
    """What the decode kernel does with un-rotated q/k: rotate them as they are loaded, then attend."""
    c, s = cos[:, None], sin[:, None]  # [B, 1, L, D]: broadcast over heads
    return sdpa(apply_rotary(q, c, s), apply_rotary(k, c, s), v, causal=True)


def test_plain_decode_forward_equals_the_model_forward(tiny_dir):
    model = load_model(tiny_dir).eval()
    x, pos = _inputs(model, "cpu")
    with torch.no_grad():
        want = model.forward_embeds(x, pos, _attend)
        got = DecodeForward(model)(x, pos, _attend_rotating)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", ["reference", "triton"])
def test_skinny_gemms_plan_matches_the_model_forward(tiny_dir, fused):
    """Split-K o/down (partials summed by the next norm) and SwiGLU in a GEMM epilogue compute the same
    hidden states as the model's layers."""
    if fused == "triton" and not _triton_runnable():
        pytest.skip("needs triton and CUDA (or TRITON_INTERPRET=1)")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel runs on CUDA, or interpreted on CPU
    model = load_model(tiny_dir).eval().to(dev)
    swiglu = swiglu_reference if fused == "reference" else functools.partial(swiglu_linear, config=(16, 32, 32, 4, 2))
    x, pos = _inputs(model, dev)
    with torch.no_grad():
        want = model.forward_embeds(x, pos, _attend)
        got = DecodeForward(model)(x, pos, _attend_rotating, SkinnyGemms(2, 4, swiglu))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="split counts"):
        SkinnyGemms(0, 1)


def test_decode_forward_reads_live_parameters(tiny_dir):
    """No copy of the weights: an in-place update (an optimizer step) is what the next call computes with."""
    model = load_model(tiny_dir).eval()
    x, pos = _inputs(model, "cpu")
    decode = DecodeForward(model)
    with torch.no_grad():
        before = decode(x, pos, _attend_rotating)
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        after = decode(x, pos, _attend_rotating)
        want = model.forward_embeds(x, pos, _attend)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, want, rtol=1e-6, atol=1e-6)


def test_kernels_import_without_the_engine_or_triton():
    """kernels/ sits under engine/ (the engine imports it, never the reverse) and builds its Triton
    kernels on first use, so every module of it imports where triton cannot be imported."""
    import subprocess
    import sys

    code = ("import sys, pkgutil, importlib\n"
            "sys.modules['triton'] = None  # any `import triton` now fails\n"
            "import rollplex.kernels as k\n"
            "for m in pkgutil.iter_modules(k.__path__): importlib.import_module(f'rollplex.kernels.{m.name}')\n"
            "bad = [m for m in sys.modules if m.startswith('rollplex.engine')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gemm_tuner_times_the_given_candidates_with_the_steps_reader(tiny_dir, monkeypatch):
    """tune_decode_gemms times each split count of the o and down projections together with the step's
    own residual-add + norm (which sums the partials), over the candidates it is given."""
    import rollplex.kernels.split_k as split_k
    from rollplex.kernels.decode_gemms import tune_decode_gemms

    fake_us = iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0])  # o: S = 1, 2, 4; down: S = 1, 2, 4
    monkeypatch.setattr(split_k, "graph_time_us", lambda call, reps, replays=7: (call(), next(fake_us))[1])
    model = load_model(tiny_dir).eval()
    decode, read = DecodeForward(model), []

    def reader(x, y, norm_w, eps):
        read.append(tuple(y.shape))
        return decode.final_norm(x, y, norm_w, eps)

    with torch.no_grad():
        gemms, times = tune_decode_gemms(model, 4, None, True, reader, decode.swiglu, split_k_candidates=(1, 2, 4))
    assert (gemms.o_splits, gemms.down_splits, gemms.gate_up_swiglu) == (2, 2, None)  # no CUDA: no fused SwiGLU
    assert times == {"o": {1: 3.0, 2: 1.0, 4: 2.0}, "down": {1: 5.0, 2: 4.0, 4: 6.0}}
    C = model.cfg.text.hidden_size
    assert read == [(4, 1, C), (2, 4, 1, C), (4, 4, 1, C)] * 2  # plain output, then fp32 partials per S
