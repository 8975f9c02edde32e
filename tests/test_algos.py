"""Advantage estimators, policy losses, KL estimators and controller against hand-computed values;
masking of padding and of tokens after EOS; the LR schedule's unit on a tiny actor."""

import math

import pytest
import torch

from rollplex.rl.algos import (
    AdaptiveKLController,
    agg_loss,
    compute_advantages,
    entropy_from_logits,
    grpo_advantages,
    kl_penalty,
    ppo_policy_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    tis_weights,
)
from rollplex.rl.batch import mask_after_eos
from rollplex.rl.rewards import choice, get_reward_fn, last_boxed, math_boxed, score, score_samples


def test_grpo_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = grpo_advantages(r, g, norm_by_std=False)
    assert torch.allclose(a, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 2.0]))  # a group of one: the reward
    a = grpo_advantages(r, g, norm_by_std=True, eps=1e-6)
    std0 = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std0 + 1e-6))
    assert torch.equal(a[4:6], torch.zeros(2))  # a constant group
    # a group of one: mean 0, std 1 (verl) -> the reward itself, 2 / (1 + 1e-6); or 0 with singleton="zero"
    assert a[6].item() == pytest.approx(2 / (1 + 1e-6)) and grpo_advantages(r, g, norm_by_std=False)[6] == 2.0
    assert grpo_advantages(r, g, singleton="zero")[6] == 0 and grpo_advantages(r, g, False, singleton="zero")[6] == 0
    with pytest.raises(ValueError, match="singleton_adv must be one of"):
        grpo_advantages(r, g, singleton="mean")


def test_rloo_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 2.0, 4.0])
    g = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    # group 0: 1 - (0+0+1)/3 = 2/3, 0 - (1+0+1)/3 = -2/3; group 1 (one sample): the reward, 3;
    # group 2: 2 - 4 = -2, 4 - 2 = 2
    expect = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, -2.0, 2.0]
    assert rloo_advantages(r, g).tolist() == pytest.approx(expect)
    assert rloo_advantages(r, g, singleton="zero").tolist() == pytest.approx(expect[:4] + [0.0] + expect[5:])


def test_reinforce_plus_plus():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    tok = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])  # outcome 1 at each last token
    # gamma 0.5: returns row 0 = [0.25, 0.5, 1], row 1 = [0.5, 1, -]; the 5 response tokens: mean 3.25/5 = 0.65,
    # deviations -0.4 -0.15 0.35 -0.15 0.35, squares sum 0.45, unbiased var 0.45/4 = 0.1125
    a = reinforce_pp_advantages(tok, mask, gamma=0.5)
    s = math.sqrt(0.1125 + 1e-8)
    assert a.tolist()[0] == pytest.approx([-0.4 / s, -0.15 / s, 0.35 / s], rel=1e-5)
    assert a.tolist()[1] == pytest.approx([-0.15 / s, 0.35 / s, 0.0], rel=1e-5)
    # the return resets past a response's end: a reward in row 1's padding does not reach its tokens
    assert torch.equal(reinforce_pp_advantages(tok + torch.tensor([[0.0, 0, 0], [0, 0, 9]]), mask, 0.5), a)
    # through compute_advantages: scores at the last tokens, a per-token penalty 0.1 (gamma 1):
    # row 0 rewards [-0.1, -0.1, 0.9] -> returns [0.7, 0.8, 0.9]; row 1 [-0.1, -0.1] -> [-0.2, -0.1];
    # mean 2.1/5 = 0.42, deviations .28 .38 .48 -.62 -.52, squares sum 1.108, var 0.277
    a, rewards = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask,
                                    torch.full((2, 3), 0.1))
    s = math.sqrt(0.277 + 1e-8)
    assert rewards.tolist() == pytest.approx([0.7, -0.2])
    assert a.flatten().tolist() == pytest.approx([0.28 / s, 0.38 / s, 0.48 / s, -0.62 / s, -0.52 / s, 0.0], rel=1e-5)


def test_reinforce_plus_plus_baseline():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    # group 0 = [1, 0]: centred 0.5, -0.5; group 1 = [3] alone: 3 (verl). Tokens 0.5 0.5 -0.5 3 3: mean 1.3,
    # deviations -.8 -.8 -1.8 1.7 1.7, squares sum 10.3, unbiased var 2.575
    a = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1]), mask)
    s = math.sqrt(2.575 + 1e-8)
    assert a.flatten().tolist() == pytest.approx([-0.8 / s, -0.8 / s, -1.8 / s, 0.0, 1.7 / s, 1.7 / s], rel=1e-5)


def test_dr_grpo_and_its_aggregation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # sequence rewards 1 - 0.1*2 = 0.8 and 0 - 0.1*3 = -0.3; centred on their mean 0.25, no std division
    a, _ = compute_advantages("dr_grpo", torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask,
                              torch.full((2, 3), 0.1))
    assert a.tolist() == pytest.approx([0.55, -0.55])
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # token sums 3 and 15, each divided by the constant 4, averaged over the 2 sequences: 18 / 8
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm", norm=4).item() == pytest.approx(2.25)
    assert agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(18 / 6)  # default: padded length
    with pytest.raises(ValueError, match="adv_estimator must be one of"):
        compute_advantages("remax_greedy", torch.zeros(2), torch.tensor([0, 0]), mask)


def test_ppo_clip_and_dual_clip():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))  # ratios 1.5, 0.5, 1.0 against old = 0
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    # positive advantage: min(r*A, clip(r)*A) -> loss = -(1.2, 0.5, 1.0) * 2
    loss, clipfrac, _, _ = ppo_policy_loss(logp, old, torch.tensor([2.0]), mask)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.0) * 2 / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    # negative advantage: max(-r*A, -clip(r)*A) -> (1.5, 0.8, 1.0) * 1
    loss, clipfrac, _, _ = ppo_policy_loss(logp, old, torch.tensor([-1.0]), mask)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.0) / 3, rel=1e-6)
    # dual clip caps the negative-advantage loss at c * |A|: ratios 5 and 1 -> losses min(5, 3) = 3 and 1;
    # the dual clip is active on 1 of 2 tokens (pg_clipfrac_lower)
    big = torch.log(torch.tensor([[5.0, 1.0]]))
    loss, _, _, lower = ppo_policy_loss(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 1.0) / 2) and lower.item() == pytest.approx(0.5)
    loss, _, _, lower = ppo_policy_loss(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((5.0 + 1.0) / 2) and lower.item() == 0  # no dual clip
    # the log-ratio is clamped to +-20 before exp (verl): a ratio of e^30 counts as e^20
    loss, *_ = ppo_policy_loss(torch.tensor([[30.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(math.exp(20), rel=1e-5)
    with pytest.raises(ValueError):
        ppo_policy_loss(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2), dual_clip=1.0)


def test_gspo_sequence_ratio():
    # sequence 0: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214; sequence 1: -0.4 and a padded token (ignored)
    # -> s = e^-0.4 = 0.6703. A = +1: max(-1.2214, -1.2) = -1.2; A = -1: max(0.6703, 0.8) = 0.8 (both clipped);
    # seq-mean-token-mean: (-1.2 + 0.8) / 2
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [-0.4, 5.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, clipfrac, _, lower = ppo_policy_loss(logp, old, adv, mask, agg_mode="seq-mean-token-mean",
                                               loss_type="gspo", dual_clip=1.1)
    assert loss.item() == pytest.approx(-0.2, rel=1e-6) and clipfrac.item() == 1.0 and lower.item() == 0
    # unclipped: the gradient is s_i's, d(-A s_i)/d logp_t = -A s_i / |y_i|, over 2 sequences
    loss, *_ = ppo_policy_loss(logp, old, adv, mask, 10.0, 10.0, agg_mode="seq-mean-token-mean", loss_type="gspo")
    (g,) = torch.autograd.grad(loss, logp)
    s0, s1 = math.exp(0.2), math.exp(-0.4)
    assert g.flatten().tolist() == pytest.approx([-s0 / 2 / 2, -s0 / 2 / 2, s1 / 2, 0.0], rel=1e-5)
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        ppo_policy_loss(logp, old, adv, mask, loss_type="gmpo")


def test_truncated_importance_sampling():
    old, rollout = torch.zeros(1, 2), torch.tensor([[-math.log(2), math.log(2)]])
    w = tis_weights(old, rollout, cap=1.5)  # exp(ln 2) = 2 capped at 1.5; exp(-ln 2) = 0.5
    assert w.flatten().tolist() == pytest.approx([1.5, 0.5])
    # ratio 1, A = 2: per-token losses -2 * (1.5, 0.5), token-mean -2
    loss, *_ = ppo_policy_loss(old, old, torch.tensor([2.0]), torch.ones(1, 2), weights=w)
    assert loss.item() == pytest.approx(-2.0)


def test_adaptive_kl_controller():
    c = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    c.update(0.2, n_steps=10)  # error clip(0.2/0.1 - 1) = 0.2: x (1 + 0.2 * 10/100) = 0.102
    assert c.value == pytest.approx(0.102)
    c.update(0.09, n_steps=10)  # error -0.1: x (1 - 0.1 * 10/100) = 0.10098
    assert c.value == pytest.approx(0.10098)


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, "k1"), torch.tensor([0.5, -1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "abs"), torch.tensor([0.5, 1.0]))
    assert torch.allclose(kl_penalty(logp, ref, "mse"), torch.tensor([0.125, 0.5]))
    # k3 with d = ref - logp = (-0.5, 1): e^-0.5 + 0.5 - 1 = 0.1065307, e - 2 = 0.7182818
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == pytest.approx([0.1065307, 0.7182818], rel=1e-6)
    assert kl_penalty(torch.zeros(1), torch.tensor([30.0]), "k3").item() == 10.0  # clamped (verl)
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


def test_rl_config_validates_the_algorithm_options():
    from rollplex.rl.config import RLConfig

    for kw, msg in [(dict(adv_estimator="remax_greedy"), "adv_estimator must be one of"),
                    (dict(policy_loss="gmpo"), "policy_loss must be one of"),
                    (dict(kl_penalty="k4"), "kl_penalty must be one of"),
                    (dict(singleton_adv="mean"), "singleton_adv must be one of"),
                    (dict(lr_schedule_unit="epoch"), "lr_schedule_unit must be one of"),
                    (dict(kl_ctrl="pid"), "kl_ctrl must be one of"),
                    (dict(adv_estimator="dr_grpo"), "seq-mean-token-sum-norm"),
                    (dict(kl_ctrl="adaptive"), "use_kl_loss=False"),
                    (dict(gamma=1.5), "gamma"), (dict(tis_imp_ratio_cap=0.0), "tis_imp_ratio_cap"),
                    (dict(dual_clip=1.0), "dual_clip")]:
        with pytest.raises(ValueError, match=msg):
            RLConfig(**kw)
    cfg = RLConfig(adv_estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum-norm", max_new_tokens=32)
    assert cfg.agg_norm == 32.0 and RLConfig(loss_agg_norm=100.0).agg_norm == 100.0
