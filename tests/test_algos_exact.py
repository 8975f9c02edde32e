"""Round-off in the RL math: a group whose rewards are all equal gets advantage exactly 0 at every group
size up to 256, for every group estimator; the value loss's clip fraction counts only clipped tokens."""

import pytest
import torch

from rollplex.rl.algos import compute_advantages, grpo_advantages, rloo_advantages, value_loss

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


def test_vf_clipfrac_counts_only_clipped_tokens():
    # v = -0.2 is within old 0.1 +- 0.5: nothing is clipped (old + clamp(v - old) rounds to v + 1 ulp)
    v, old, ret = torch.tensor([[-0.2]]), torch.tensor([[0.1]]), torch.tensor([[0.0]])
    loss, clipfrac = value_loss(v, old, ret, torch.ones(1, 1), cliprange_value=0.5)
    assert clipfrac.item() == 0.0
    assert loss.item() == pytest.approx(0.5 * 0.04)
    # random values, none clipped: clip fraction exactly 0 and the loss is the unclipped one
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(64, 32, generator=gen)
    v = old + (torch.rand(64, 32, generator=gen) - 0.5) * 0.9  # |v - old| < 0.45 < c
    ret = torch.randn(64, 32, generator=gen)
    mask = (torch.rand(64, 32, generator=gen) > 0.2).float()
    loss, clipfrac = value_loss(v, old, ret, mask, cliprange_value=0.5)
    assert clipfrac.item() == 0.0
    assert loss.item() == pytest.approx(0.5 * (((v - ret) ** 2) * mask).sum().item() / mask.sum().item(), rel=1e-6)
    # tokens clipped and the clipped term larger are counted (and only those)
    v = torch.tensor([[1.0, -1.0, 0.3]])
    old, ret = torch.zeros(1, 3), torch.tensor([[2.0, 0.0, 0.0]])
    # token 0: clip(1) = 0.5, (0.5-2)^2 = 2.25 > 1 -> counted; token 1: clip(-1) = -0.5, 0.25 < 1 -> not;
    # token 2: not clipped
    loss, clipfrac = value_loss(v, old, ret, torch.ones(1, 3), cliprange_value=0.5)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.09) / 3)
    # the gradient flows through v where it is within the clip range (as verl's clip_by_value)
    v = torch.tensor([[0.2]], requires_grad=True)
    value_loss(v, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.5)[0].backward()
    assert v.grad.item() == pytest.approx(0.2 - 1.0)
