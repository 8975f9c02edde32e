"""Chunked token logprobs equal log_softmax + gather in value and in gradients (hidden and head)."""

import pytest
import torch

from rollplex.rl.logprob import token_logprob


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 1024)])
def test_chunked_logprob_matches_log_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (3, 11), generator=g)
    upstream = torch.randn(3, 11, generator=g, dtype=torch.float64)
    ref = torch.log_softmax(h @ w.t() / temperature, -1).gather(-1, y[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = token_logprob(h, w, y, temperature, chunk)
    (got * upstream).sum().backward()
    # the chunked path computes softmax statistics in fp32: agreement to fp32 precision
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(h.grad, gh, rtol=1e-5, atol=1e-5) and torch.allclose(w.grad, gw, rtol=1e-5, atol=1e-5)
