"""Split-K projections (kernels/split_k.py): the fp32 partials of a K-sliced GEMM sum to F.linear where
their reader adds them, and the tuner times each split count together with that reader."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollplex.kernels.split_k import add_linear_out, check_candidates, split_k_linear, tune_split_k


@pytest.mark.parametrize("S", [2, 4])
def test_split_k_linear_partials_sum_to_f_linear(S) -> None:
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


def test_candidates_must_be_positive_ints() -> None:
    check_candidates((1, 2, 4))
    for bad in ((), (0,), (2, -1), (True,), [1, 2]):
        with pytest.raises(ValueError, match="split-K"):
            check_candidates(bad)
