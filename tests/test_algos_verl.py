"""The RL math against verl's definitions (verl/trainer/ppo/core_algos.py), each re-derived here from its
formula, element by element in plain Python loops, on random inputs: ragged masks (gaps inside a
response, empty rows), groups of one, ties, all-equal rewards, log-ratios past +-20."""

import math

import pytest
import torch

from rollplex.rl.algos import compute_advantages, reinforce_pp_advantages


def _whiten(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """verl's masked_whiten: (v - mean) / sqrt(unbiased var + 1e-8) over the masked entries."""
    xs = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(row, mrow)]
            for row, mrow in zip(values, mask)]


def _ragged_mask(gen: torch.Generator, n: int, r: int) -> torch.Tensor:
    """[n, r] 0/1 with random lengths (an empty row too) and random gaps inside the responses."""
    lengths = torch.randint(1, r + 1, (n,), generator=gen)
    lengths[0] = 0
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    gaps = (torch.rand(n, r, generator=gen) < 0.25).float()
    gaps[:, 0] = 0
    return mask * (1 - gaps)


def verl_reinforce_pp(tok: list[list[float]], mask: list[list[float]], gamma: float) -> list[list[float]]:
    """REINFORCE++'s returns: running = r_t + gamma running at a response token; an observation token
    (mask 0) gets 0 and leaves the running return as it was; then whitened."""
    returns = []
    for row, mrow in zip(tok, mask):
        running, out = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if mrow[t]:
                running = row[t] + gamma * running
                out[t] = running
        returns.append(out)
    return _whiten(returns, mask)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_carries_returns_through_observation_gaps(gamma):
    gen = torch.Generator().manual_seed(1)
    mask = _ragged_mask(gen, 12, 9)
    tok = torch.randn(12, 9, generator=gen) * mask + torch.randn(12, 9, generator=gen) * (1 - mask)
    a = reinforce_pp_advantages(tok, mask, gamma)
    assert a.tolist() == [pytest.approx(row, abs=1e-5) for row in verl_reinforce_pp(tok.tolist(), mask.tolist(),
                                                                                     gamma)]
    # by hand: a reward after an observation gap reaches the tokens before it (gamma 1, no reset)
    m = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    tok = torch.tensor([[0.0, 5.0, 5.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # the gap's own rewards are dropped
    returns = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert reinforce_pp_advantages(tok, m, 1.0).tolist() == [pytest.approx(r, abs=1e-6)
                                                              for r in _whiten(returns, m.tolist())]
    adv, _ = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), m)
    assert adv[0, 0] == adv[0, 3] > 0
