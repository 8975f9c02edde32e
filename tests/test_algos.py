"""GRPO / PPO / KL math against hand-computed values; masking of padding and of tokens after EOS."""

import math

import pytest
import torch

from rollplex.rl.algos import agg_loss, entropy_from_logits, grpo_advantages, kl_penalty, ppo_policy_loss
from rollplex.rl.batch import mask_after_eos
from rollplex.rl.rewards import choice, get_reward_fn, last_boxed, math_boxed, score, score_samples


def test_grpo_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = grpo_advantages(r, g, norm_by_std=False)
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]))
    a = grpo_advantages(r, g, norm_by_std=True, eps=1e-6)
    std0 = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std0 + 1e-6))
    assert torch.equal(a[4:6], torch.zeros(2)) and a[6] == 0  # constant group; a group of one


def test_ppo_clip_and_dual_clip():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old = 0
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # positive advantage: min(r*A, clip(r)*A) -> loss = -(1.2, 0.5, 1.0) * 2
    loss, clipfrac, _ = ppo_policy_loss(logp, old, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.0) * 2 / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    # negative advantage: max(-r*A, -clip(r)*A) -> (1.5, 0.8, 1.0) * 1
    loss, clipfrac, _ = ppo_policy_loss(logp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.0) / 3, rel=1e-6)
    # dual clip caps the negative-advantage loss at c * |A|
    big = torch.log(torch.tensor([[5.0]]))
    loss, _, _ = ppo_policy_loss(big, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    with pytest.raises(ValueError):
        ppo_policy_loss(big, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), dual_clip=1.0)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.125, 0.5]))
    d = ref - logp
    assert torch.allclose(kl_penalty(logp, ref, "low_var_kl"), torch.exp(d) - d - 1)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_aggregation_modes_and_masking():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # padding must not count
    assert agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    # micro-batches with the global denominator sum to the whole
    parts = sum(agg_loss(loss[i : i + 1], mask[i : i + 1], "token-mean", 4.0) for i in range(2))
    assert parts.item() == pytest.approx(10 / 4)


def test_mask_after_eos():
    resp = torch.tensor([[5, 6, 2, 7, 8], [2, 9, 9, 9, 9], [5, 5, 5, 5, 5]])
    pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).float()
    m = mask_after_eos(resp, eos_id=2, mask=pad)
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]


def test_entropy():
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))


def test_rewards():
    assert choice(None, "B", "B") == 1.0 and choice(None, "The answer is C.", "B") == 0.0
    assert choice(None, "A<|im_end|>", "A") == 1.0 and choice(None, "a", "A") == 0.0
    assert last_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert math_boxed(None, r"\boxed{30^\circ}", "30")["score"] == pytest.approx(1.0)
    assert math_boxed(None, r"\boxed{31}", "30")["score"] == pytest.approx(0.1)
    assert math_boxed(None, "30", "30")["score"] == 0.0
    s, extra = score(get_reward_fn("geo3k"), "hiyouga/geometry3k", r"\boxed{4}", "4")
    assert s == pytest.approx(1.0) and extra == {"acc": 1.0, "format": 1.0}
    assert get_reward_fn("rollplex.rl.rewards:exact_match")(None, " Yes. ", "yes") == 1.0
    assert get_reward_fn(None)("rollplex/shape_color", "D", "D") == 1.0
    with pytest.raises(ValueError):
        get_reward_fn("nope:missing")
    with pytest.raises(ValueError):
        get_reward_fn("not_registered")


def test_score_samples():
    texts = [r"\boxed{4}", r"\boxed{5}", "4"]
    scores, extra = score_samples(math_boxed, ["geo3k"] * 3, texts, ["4"] * 3, [None] * 3)
    assert scores == pytest.approx([1.0, 0.1, 0.0])
    assert extra == {"critic/score/acc": pytest.approx(1 / 3), "critic/score/format": pytest.approx(2 / 3)}

    def picky(ds, text, gt, info=None):
        return {"x": 1.0, "y": float("nan")}[text]

    with pytest.raises(ValueError, match="'picky' failed on sample 1: KeyError"):
        score_samples(picky, [None] * 2, ["x", "z"], [None] * 2, [None] * 2)
    with pytest.raises(ValueError, match="reward 'mine' returned nan for sample 0"):
        score_samples(picky, [None], ["y"], [None], [None], name="mine")
