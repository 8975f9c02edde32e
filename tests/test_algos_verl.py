"""The RL math against verl's definitions (verl/trainer/ppo/core_algos.py), each re-derived here from its
formula, element by element in plain Python loops, on random inputs: ragged masks (gaps inside a
response, empty rows), groups of one, ties, all-equal rewards, log-ratios past +-20."""

import math

import pytest
import torch

from rollplex.rl.algos import (
    PolicyLossParams,
    agg_denominator,
    compute_advantages,
    kl_penalty,
    ppo_policy_loss,
    reinforce_pp_advantages,
    remax_advantages,
)


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


# ---------------------------------------------------------------------------------------------------------------
# policy losses: verl's per-token terms and aggregation, element by element

def _inputs(seed: int, n: int = 10, r: int = 8, token_adv: bool = False):
    """(logp, old, adv, mask): log-ratios mostly within +-0.5, a few past +-20, a zero advantage, ragged
    masks with gaps and an empty row; adv [N] (a sequence's advantage) or [N, R]."""
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, r, generator=gen) * 3 - 0.01
    old = logp + torch.randn(n, r, generator=gen) * 0.3
    old[1, 0], old[2, 1], old[3, 2] = logp[1, 0] + 25.0, logp[2, 1] - 22.0, logp[3, 2] - 0.0  # |log r| > 20
    adv = torch.randn(n, r, generator=gen) if token_adv else torch.randn(n, generator=gen)
    adv[4] = 0.0
    return logp, old, adv, _ragged_mask(gen, n, r)


def _rows(x: torch.Tensor, adv: torch.Tensor) -> tuple[list, list]:
    a = adv[:, None].expand_as(x) if adv.dim() == 1 else adv
    return x.tolist(), a.tolist()


def verl_agg(loss: list[list[float]], mask: list[list[float]], mode: str, norm: float | None = None) -> float:
    """verl's agg_loss over one whole batch."""
    seqs = [(sum(l * m for l, m in zip(lr, mr)), sum(mr)) for lr, mr in zip(loss, mask)]
    live = [(s, c) for s, c in seqs if c > 0]
    if mode == "token-mean":
        return sum(s for s, _ in seqs) / sum(c for _, c in seqs)
    if mode == "token-sum":
        return sum(s for s, _ in seqs)
    if mode == "seq-mean-token-mean":
        return sum(s / c for s, c in live) / len(live)
    if mode == "seq-mean-token-sum":
        return sum(s for s, _ in live) / len(live)
    assert mode == "seq-mean-token-sum-norm"
    return sum(s for s, _ in live) / len(live) / (norm if norm is not None else len(mask[0]))


def _ratio(lp: float, old: float, clamp: bool = True) -> float:
    x = lp - old
    return math.exp(max(-20.0, min(20.0, x)) if clamp else x)


def _clip(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


def verl_sapo(logp, old, adv, tau_pos, tau_neg):
    out = []
    for lr, orow, ar in zip(logp, old, adv):
        row = []
        for lp, o, a in zip(lr, orow, ar):
            tau = tau_pos if a > 0 else tau_neg
            row.append(-a * (1 / (1 + math.exp(-tau * (_ratio(lp, o) - 1)))) * 4 / tau)
        out.append(row)
    return out


def verl_cispo(logp, old, adv, low, high):
    return [[-_clip(_ratio(lp, o), 1 - low, 1 + high) * a * lp for lp, o, a in zip(lr, orow, ar)]
            for lr, orow, ar in zip(logp, old, adv)]


def verl_gpg_loss(logp, adv):
    return [[-lp * a for lp, a in zip(lr, ar)] for lr, ar in zip(logp, adv)]


def verl_ppo_terms(logp, old, adv, low, high, clamp):
    """(max(-A r, -A clip(r)), clipped-is-larger) per token, r clamped or not."""
    loss, clipped = [], []
    for lr, orow, ar in zip(logp, old, adv):
        lrow, crow = [], []
        for lp, o, a in zip(lr, orow, ar):
            r = _ratio(lp, o, clamp)
            l1, l2 = -a * r, -a * _clip(r, 1 - low, 1 + high)
            lrow.append(max(l1, l2))
            crow.append(l2 > l1)
        loss.append(lrow)
        clipped.append(crow)
    return loss, clipped


def _token_mean(values, mask) -> float:
    flat = [(v, m) for vr, mr in zip(values, mask) for v, m in zip(vr, mr)]
    return sum(v * m for v, m in flat) / sum(m for _, m in flat)


def verl_covariance(logp, adv, mask):
    ma, ml = _token_mean(adv, mask), _token_mean(logp, mask)
    return [[(a - ma) * (lp - ml) for lp, a in zip(lr, ar)] for lr, ar in zip(logp, adv)]


def verl_geo_mean(logp, old, adv, mask, low, high, weights=None):
    """GMPO per sequence, averaged over the non-empty sequences; (loss, clipfrac A>0, clipfrac A<0)."""
    per_seq, up, down, tokens = [], 0, 0, 0
    for i, (lr, orow, ar, mr) in enumerate(zip(logp, old, adv, mask)):
        n = sum(mr)
        xs, adv_sum, logw = 0.0, 0.0, 0.0
        for t, (lp, o, a, m) in enumerate(zip(lr, orow, ar, mr)):
            x = lp - o
            s = (a > 0) - (a < 0)
            xc = _clip(x, -low, high)
            xs += s * min(s * x, s * xc) * m
            adv_sum += a * m
            if weights is not None:
                logw += math.log(weights[i][t] + 1e-10) * m
            tokens += m
            up += m * (x != xc and a > 0)
            down += m * (x != xc and a < 0)
        if n:
            w = math.exp(logw / n) if weights is not None else 1.0
            per_seq.append(-(adv_sum / n) * math.exp(xs / n) * w)
    return sum(per_seq) / len(per_seq), up / tokens, down / tokens


@pytest.mark.parametrize("token_adv", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
def test_policy_losses_match_verl(mode, token_adv):
    logp, old, adv, mask = _inputs(3, token_adv=token_adv)
    lp, a = _rows(logp, adv)
    o, m = old.tolist(), mask.tolist()
    low, high = 0.2, 0.28

    def ours(loss_type, **kw):
        return ppo_policy_loss(logp, old, adv, mask, low, high, None, mode, loss_type=loss_type, **kw)

    # sapo: per sequence whatever the mode (verl forces seq-mean-token-mean), nothing clipped
    loss, cf, _, cfl = ours("sapo", params=PolicyLossParams(tau_pos=1.0, tau_neg=1.05))
    assert loss.item() == pytest.approx(verl_agg(verl_sapo(lp, o, a, 1.0, 1.05), m, "seq-mean-token-mean"), rel=1e-5)
    assert cf.item() == cfl.item() == 0.0
    loss, *_ = ours("sapo", params=PolicyLossParams(tau_pos=2.0, tau_neg=3.0))
    assert loss.item() == pytest.approx(verl_agg(verl_sapo(lp, o, a, 2.0, 3.0), m, "seq-mean-token-mean"), rel=1e-5)
    # cispo: the clipped ratio times -A logp, by the mode
    loss, cf, ppo_kl, _ = ours("cispo")
    assert loss.item() == pytest.approx(verl_agg(verl_cispo(lp, o, a, low, high), m, mode), rel=1e-5)
    ratio = torch.exp((logp - old).clamp(-20, 20))
    assert cf.item() == pytest.approx(_token_mean((ratio != ratio.clamp(1 - low, 1 + high)).float().tolist(), m))
    assert ppo_kl.item() == pytest.approx(_token_mean((old - logp).tolist(), m), rel=1e-5)
    # gpg and reinforce: -A logp
    for name in ("gpg", "reinforce"):
        loss, cf, _, _ = ours(name)
        assert loss.item() == pytest.approx(verl_agg(verl_gpg_loss(lp, a), m, mode), rel=1e-5) and cf.item() == 0.0
    # geo_mean: a mean over sequences whatever the mode
    loss, cf, _, cfl = ours("geo_mean")
    expect = verl_geo_mean(lp, o, a, m, low, high)
    assert [loss.item(), cf.item(), cfl.item()] == pytest.approx(list(expect), rel=1e-5)


def test_clip_cov_matches_verl():
    for seed in range(4):
        logp, old, adv, mask = _inputs(10 + seed, n=12, r=10)
        lp, a = _rows(logp, adv)
        o, m = old.tolist(), mask.tolist()
        base, clipped = verl_ppo_terms(lp, o, a, 0.2, 0.2, clamp=False)
        cov = verl_covariance(lp, a, m)
        lb, ub = -0.05, 0.3
        cand = [i * len(m[0]) + t for i in range(len(m)) for t in range(len(m[0]))
                if m[i][t] and not clipped[i][t] and lb < cov[i][t] < ub]
        assert len(cand) > 3
        # every candidate cut: ratio 1 -> max(int(ratio x tokens), 1) >= candidates; no draw involved
        params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub)
        loss, cf, _, _ = ppo_policy_loss(logp, old, adv, mask, loss_type="clip_cov", params=params)
        cut = [[0.0 if i * len(m[0]) + t in cand else 1.0 for t in range(len(m[0]))] for i in range(len(m))]
        expect = [[b * c for b, c in zip(br, cr)] for br, cr in zip(base, cut)]
        assert loss.item() == pytest.approx(verl_agg(expect, m, "token-mean"), rel=1e-5)
        assert cf.item() == pytest.approx(len(cand) / sum(map(sum, m)))
        # a fraction: k = max(int(ratio x tokens), 1) of the candidates, drawn by a permutation of them
        ratio = 2.5 / sum(map(sum, m))
        k = max(int(ratio * sum(map(sum, m))), 1)
        perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))[:k].tolist()
        chosen = {cand[j] for j in perm}
        params = PolicyLossParams(clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
        loss, cf, _, _ = ppo_policy_loss(logp, old, adv, mask, loss_type="clip_cov", params=params,
                                         generator=torch.Generator().manual_seed(seed))
        expect = [[0.0 if i * len(m[0]) + t in chosen else base[i][t] for t in range(len(m[0]))]
                  for i in range(len(m))]
        assert loss.item() == pytest.approx(verl_agg(expect, m, "token-mean"), rel=1e-5)
        assert cf.item() == pytest.approx(k / sum(map(sum, m)))
    # the cut tokens get no gradient; the others PPO's
    logp, old, adv, mask = _inputs(20)
    logp.requires_grad_(True)
    params = PolicyLossParams(clip_cov_ratio=1.0, clip_cov_lb=-1e3, clip_cov_ub=1e3)
    ppo_policy_loss(logp, old, adv, mask, loss_type="clip_cov", params=params)[0].backward()
    assert torch.equal(logp.grad * mask, torch.zeros_like(logp))  # every unclipped token cut, clipped ones flat


def test_kl_cov_matches_verl():
    for seed, ratio, coef in ((0, 0.1, 1.0), (1, 0.3, 0.1), (2, 1e-4, 0.5)):
        logp, old, adv, mask = _inputs(30 + seed, n=12, r=10, token_adv=seed == 1)
        lp, a = _rows(logp, adv)
        o, m = old.tolist(), mask.tolist()
        cov = verl_covariance(lp, a, m)
        valid = [(cov[i][t], i, t) for i in range(len(m)) for t in range(len(m[0])) if m[i][t]]
        k = max(1, int(len(valid) * ratio))
        top = {(i, t) for _, i, t in sorted(valid, reverse=True)[:k]}
        expect = [[-a[i][t] * _ratio(lp[i][t], o[i][t], clamp=False)
                   + (coef * abs(lp[i][t] - o[i][t]) if (i, t) in top else 0.0)
                   for t in range(len(m[0]))] for i in range(len(m))]
        params = PolicyLossParams(kl_cov_ratio=ratio, ppo_kl_coef=coef)
        for mode in ("token-mean", "seq-mean-token-mean"):
            loss, cf, _, _ = ppo_policy_loss(logp, old, adv, mask, agg_mode=mode, loss_type="kl_cov", params=params)
            assert loss.item() == pytest.approx(verl_agg(expect, m, mode), rel=1e-5)
            assert cf.item() == pytest.approx(k / len(valid))


def test_geo_mean_with_tis_and_gradient():
    logp, old, adv, mask = _inputs(5, token_adv=True)
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(*logp.shape, generator=gen) * 2
    lp, a = _rows(logp, adv)
    loss, cf, _, cfl = ppo_policy_loss(logp, old, adv, mask, 0.4, 0.4, loss_type="geo_mean", weights=w)
    expect = verl_geo_mean(lp, old.tolist(), a, mask.tolist(), 0.4, 0.4, w.tolist())
    assert [loss.item(), cf.item(), cfl.item()] == pytest.approx(list(expect), rel=1e-5)
    # a micro-batch split with the mini-batch's denominator sums to the whole (the actor's accumulation)
    denom = agg_denominator(mask, "seq-mean-token-mean")
    parts = [ppo_policy_loss(logp[s], old[s], adv[s], mask[s], 0.4, 0.4, loss_type="geo_mean", denominator=denom)[0]
             for s in (slice(0, 4), slice(4, None))]
    whole = ppo_policy_loss(logp, old, adv, mask, 0.4, 0.4, loss_type="geo_mean")[0]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_loss_gradients():
    logp, old, adv, mask = _inputs(7)
    a = adv[:, None].expand_as(logp)
    r = torch.exp((logp - old).clamp(-20, 20))
    n = mask.sum()

    def grad(loss_type, **kw):
        x = logp.clone().requires_grad_(True)
        ppo_policy_loss(x, old, adv, mask, 0.2, 0.28, loss_type=loss_type, **kw)[0].backward()
        return x.grad

    # cispo: the clipped weight is a constant, the gradient is REINFORCE's times it
    w = r.clamp(0.8, 1.28)
    assert torch.allclose(grad("cispo"), -w * a * mask / n, atol=1e-7)
    assert torch.allclose(grad("gpg"), -a * mask / n) and torch.allclose(grad("reinforce"), -a * mask / n)
    # sapo: d/dlogp [-A sigmoid(tau (r - 1)) 4 / tau] = -A 4 s (1 - s) r, per sequence (token mean, seq mean)
    tau = torch.where(a > 0, 1.0, 1.05)
    s = torch.sigmoid(tau * (r - 1))
    inside = (logp - old).abs() < 20  # past the clamp the gradient is 0
    per_tok = -a * 4 * s * (1 - s) * r * inside
    n_seq = (mask.sum(-1) > 0).sum()
    expect = per_tok * mask / mask.sum(-1, keepdim=True).clamp_min(1) / n_seq
    assert torch.allclose(grad("sapo"), expect, atol=1e-6)
    # on-policy, sapo's gradient is PPO's: f'(1) = 1
    x = logp.clone().requires_grad_(True)
    ppo_policy_loss(x, logp, adv, mask, loss_type="sapo")[0].backward()
    y = logp.clone().requires_grad_(True)
    ppo_policy_loss(y, logp, adv, mask, agg_mode="seq-mean-token-mean", loss_type="vanilla")[0].backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-7)


def test_unknown_loss_and_bad_params():
    logp, old, adv, mask = _inputs(0)
    with pytest.raises(ValueError, match="policy_loss must be one of"):
        ppo_policy_loss(logp, old, adv, mask, loss_type="dppo")
    for kw in (dict(tau_pos=0.0), dict(tau_neg=-1.0), dict(clip_cov_ratio=0.0), dict(kl_cov_ratio=1.5),
               dict(clip_cov_lb=5.0, clip_cov_ub=1.0), dict(ppo_kl_coef=-0.1)):
        with pytest.raises(ValueError):
            PolicyLossParams(**kw)


# ---------------------------------------------------------------------------------------------------------------
# advantage estimators: verl's per-group loops

def _groups(seed: int):
    """(rewards [N], group ids [N], mask [N, R]): groups of 1..6 with ties, an all-equal group, zero rewards."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 6, 4, 3]
    group = torch.cat([torch.full((k,), i) for i, k in enumerate(sizes)])
    rewards = torch.randint(0, 3, (group.numel(),), generator=gen).float() * 0.5  # ties
    rewards[group == 5] = 0.9  # all equal
    rewards[group == 2] = torch.randn(3, generator=gen)
    return rewards, group, _ragged_mask(gen, group.numel(), 7)


def _by_group(group: torch.Tensor) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        out.setdefault(g, []).append(i)
    return out


def verl_opo(rewards, group, lengths):
    adv = list(rewards)
    for members in _by_group(group).values():
        if len(members) > 1:
            base = sum(lengths[i] * rewards[i] for i in members) / sum(lengths[i] for i in members)
        else:
            base = 0.0
        for i in members:
            adv[i] = rewards[i] - base
    return adv


def verl_passk(rewards, group, norm_by_std, eps=1e-6):
    adv = [0.0] * len(rewards)
    for members in _by_group(group).values():
        vals = [rewards[i] for i in members]
        order = sorted(range(len(vals)), key=lambda j: -vals[j])
        gap = vals[order[0]] - vals[order[1]]
        if norm_by_std:
            mean = sum(vals) / len(vals)
            gap /= math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) + eps
        adv[members[order[0]]] = gap
    return adv


def verl_gpg(rewards, group):
    alpha = len(rewards) / max(sum(r != 0 for r in rewards), 1)
    adv = list(rewards)
    for members in _by_group(group).values():
        mean = sum(rewards[i] for i in members) / len(members) if len(members) > 1 else 0.0
        for i in members:
            adv[i] = alpha * (rewards[i] - mean)
    return adv


@pytest.mark.parametrize("seed", range(3))
def test_estimators_match_verl(seed):
    rewards, group, mask = _groups(seed)
    r, lengths = rewards.tolist(), mask.sum(-1).tolist()
    adv, seq = compute_advantages("opo", rewards, group, mask)
    assert adv.tolist() == pytest.approx(verl_opo(r, group, lengths), abs=1e-6) and torch.equal(seq, rewards)
    adv, _ = compute_advantages("gpg", rewards, group, mask)
    assert adv.tolist() == pytest.approx(verl_gpg(r, group), abs=1e-6)
    # pass@k needs groups of two or more: drop the lone sample
    keep = group != 0
    for norm in (True, False):
        adv, _ = compute_advantages("grpo_passk", rewards[keep], group[keep] - 1, mask[keep], norm_by_std=norm)
        assert adv.tolist() == pytest.approx(verl_passk(rewards[keep].tolist(), group[keep] - 1, norm), abs=1e-5)
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        compute_advantages("grpo_passk", rewards, group, mask)
    # a lone sample with singleton="zero" gets 0 (verl: the reward, alpha x the reward)
    for est in ("opo", "gpg"):
        assert compute_advantages(est, rewards, group, mask, singleton="zero")[0][0] == 0.0


def test_estimators_by_hand():
    g = torch.tensor([0, 0, 0, 1, 1])
    mask = torch.tensor([[1.0] * 4, [1.0, 1, 0, 0], [1.0, 0, 0, 0], [1.0] * 4, [1.0] * 4])
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    # opo: group 0 baseline (4 x 1 + 2 x 0 + 1 x 1) / 7 = 5/7; group 1: 0
    assert compute_advantages("opo", r, g, mask)[0].tolist() == pytest.approx([2 / 7, -5 / 7, 2 / 7, 0, 0])
    # gpg: alpha = 5 / 2 non-zero rewards; group 0 mean 2/3
    assert compute_advantages("gpg", r, g, mask)[0].tolist() == pytest.approx(
        [2.5 / 3, -2.5 * 2 / 3, 2.5 / 3, 0, 0])
    # pass@k: group 0's best two tie (1, 1): 0 for all; group 1 all equal: 0
    assert compute_advantages("grpo_passk", r, g, mask)[0].tolist() == [0.0] * 5
    r = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0])
    std0 = math.sqrt(((1 - 0.5) ** 2 + 0.5**2 + 0) / 2)
    std1 = math.sqrt(2 * 0.1**2)
    assert compute_advantages("grpo_passk", r, g, mask)[0].tolist() == pytest.approx(
        [0.5 / (std0 + 1e-6), 0, 0, 0.2 / (std1 + 1e-6), 0])


def test_remax_matches_verl():
    gen = torch.Generator().manual_seed(0)
    mask = _ragged_mask(gen, 6, 5)
    tok = torch.randn(6, 5, generator=gen)
    base = torch.randn(6, generator=gen)
    adv, ret = remax_advantages(tok, base, mask)
    for i in range(6):
        for t in range(5):
            g = sum(tok[i, s].item() * mask[i, s].item() for s in range(t, 5))
            assert ret[i, t].item() == pytest.approx(g, abs=1e-5)
            assert adv[i, t].item() == pytest.approx(g - base[i].item() * mask[i, t].item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# KL: the straight-through "+" estimators

def test_straight_through_kl():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen) * 3
    ref = logp + torch.randn(4, 6, generator=gen)
    ref[0, 0] = logp[0, 0] + 30.0  # past the +-20 clamp
    for base in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
        x = logp.clone().requires_grad_(True)
        value = kl_penalty(x, ref, base + "+")
        assert torch.equal(value.detach(), kl_penalty(logp, ref, base))  # the base estimator's value
        value.sum().backward()
        assert torch.allclose(x.grad, logp - ref)  # k2's gradient: d/dlogp (logp - ref)^2 / 2
    # k3 itself has a different gradient: 1 - exp(ref - logp) (0 where clamped)
    x = logp.clone().requires_grad_(True)
    kl_penalty(x, ref, "k3").sum().backward()
    assert not torch.allclose(x.grad, logp - ref)
    with pytest.raises(ValueError, match="kl kind must be one of"):
        kl_penalty(logp, ref, "k3++")
