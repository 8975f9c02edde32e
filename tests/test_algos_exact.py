"""Round-off in the RL math: a group whose rewards are all equal gets advantage exactly 0 at every group
size up to 256, for every group estimator."""

import pytest
import torch

from rollplex.rl.algos import compute_advantages, grpo_advantages, rloo_advantages

# rewards a real run produces (math_boxed gives 0.1 for a formatted wrong answer) and ones with long mantissas
VALUES = (0.1, 0.9, 1.1, 1.0 / 3.0, 0.7, -0.3, 123.456, 1e-3)
SIZES = range(2, 257)


def _equal_groups(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One group of each size 2..256, every reward `value`: (rewards [N], group ids [N])."""
    group = torch.cat([torch.full((n,), i) for i, n in enumerate(SIZES)])
    return torch.full((group.numel(),), value), group


@pytest.mark.parametrize("value", VALUES)
def test_equal_group_has_zero_advantage_at_every_size(value):
    rewards, group = _equal_groups(value)
    assert torch.equal(grpo_advantages(rewards, group), torch.zeros_like(rewards))
    assert torch.equal(grpo_advantages(rewards, group, norm_by_std=False), torch.zeros_like(rewards))
    assert torch.equal(rloo_advantages(rewards, group), torch.zeros_like(rewards))
    # the outcome score at each response's last token, through the dispatcher (ragged lengths)
    lengths = torch.arange(group.numel()) % 5 + 1
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = compute_advantages(est, rewards, group, mask)
        assert torch.equal(adv, torch.zeros_like(adv)), est


def test_equal_group_next_to_a_varied_one():
    # an equal group's statistics are its own: a neighbouring group with spread changes nothing
    for n in SIZES:
        r = torch.cat([torch.full((n,), 0.9), torch.linspace(0.0, 1.0, 7)])
        g = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(7, dtype=torch.long)])
        a = grpo_advantages(r, g)
        assert torch.equal(a[:n], torch.zeros(n)), n
        assert a[n:].abs().max() > 0.5


def test_lone_sample_keeps_verl_semantics():
    r, g = torch.tensor([0.1]), torch.tensor([0])
    assert grpo_advantages(r, g, norm_by_std=False).item() == pytest.approx(0.1)
    assert grpo_advantages(r, g, singleton="zero").item() == 0.0
