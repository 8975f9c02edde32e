"""RL math on padded [N, R] response tensors with a 0/1 `mask` (1 = a response token).

Names and semantics follow verl (core_algos.py); every function is pure tensor math, checked against
hand-computed values in tests/test_algos.py.

Advantage estimators (`compute_advantages`, `RLConfig.adv_estimator`). The outcome reward sits at a
response's last token; a KL-in-reward penalty is subtracted per token (verl's token_level_rewards):

  grpo                          (r - mean_group) / (std_group + 1e-6), std unbiased; [N]
  dr_grpo                       r - mean_group (no std division, Dr.GRPO); meant with the
                                `seq-mean-token-sum-norm` aggregation; [N]
  rloo                          r - mean of the group's *other* samples = (n r - sum) / (n - 1); [N]
  reinforce_plus_plus           per-token discounted return G_t = r_t + gamma G_{t+1} over the response
                                tokens (carried through masked gaps inside a response, 0 past its end),
                                whitened over all response tokens of the batch
                                ((G - mean) / sqrt(var_unbiased + 1e-8), mean not added back); [N, R]
  reinforce_plus_plus_baseline  r - mean_group broadcast over the tokens, then whitened the same way; [N, R]
  gae                           PPO with a critic (rl/critic.py): per-token rewards r_t and values V_t (the
                                value predicted at the position before token t), TD errors
                                delta_t = r_t + gamma V_{t+1} - V_t (V past the response's end = 0) and
                                A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t (the critic's
                                targets, before whitening); A whitened over the batch's response tokens
                                (verl's masked_whiten); [N, R]

A group of one sample: verl takes mean 0 (and std 1), so the advantage is the reward itself
(`singleton="reward"`, the default); `singleton="zero"` gives it advantage 0 before any whitening
(Rollplex's earlier behaviour: a lone sample has no baseline to compare with).

Policy losses (`ppo_policy_loss`, `RLConfig.policy_loss`): `vanilla` is PPO-clip with verl's dual clip
(clip_ratio_c; a negative-advantage token's loss is capped at c·|A|) and the log-ratio clamped to ±20
before `exp`; `pg_clipfrac_lower` is the fraction of tokens where the dual clip is active. `gspo` uses
the sequence-level ratio s_i = exp(mean over the sequence's tokens of (logp - old)), applied per token
as exp(sg[log s_i] + logp - sg[logp]) (so the gradient is s_i's), log clamped at 10, clipped per
sequence with clip_ratio_low/high (verl's GSPO recipe uses 3e-4 / 4e-4) and aggregated
seq-mean-token-mean whatever `loss_agg_mode` says (as verl does); no dual clip. Truncated importance
sampling (verl's tis_imp_ratio_cap): the per-token loss times min(exp(old - rollout), cap), detached.

KL estimators (`kl_penalty`): kl/k1 = logp - ref, abs = |logp - ref|, mse/k2 = (logp - ref)^2 / 2,
low_var_kl/k3 = exp(ref - logp) - (ref - logp) - 1 with the difference clamped to ±20 and the result
to ±10. The KL loss defaults to low_var_kl and the KL-in-reward penalty to kl (both verl's defaults).
`AdaptiveKLController` is verl's: coef *= 1 + clip(kl / target - 1, ±0.2) · n_samples / horizon.

Value loss (`value_loss`, verl's compute_value_loss): 0.5 max((v - R)^2, (clip(v, v_old ± cliprange_value)
- R)^2) per token, aggregated by `loss_agg_mode`; vf_clipfrac is the fraction of response tokens where the
clipped term is the larger.

Aggregation with micro-batches: a loss computed on a micro-batch and divided by the *global*
normaliser (`agg_denominator` over the whole mini-batch) sums to the mini-batch loss, so gradients
do not depend on how samples were grouped into micro-batches — which is what lets the shared-prefix
(`rollplex`) and per-sample (`serial`) modes produce the same update.

Differences from verl that remain:
- `seq-mean-token-sum-norm` is the mean over sequences of (token sum / C), C = `loss_agg_norm`
  (default: the step's max_new_tokens). verl divides the sum over a micro-batch's sequences by that
  micro-batch's padded length, so its value depends on padding and micro-batch size.
- The entropy and KL loss terms use the same aggregation as the policy loss, also under gspo.
- `dual_clip=None` turns the dual clip off (verl always applies clip_ratio_c).
- Truncated importance sampling also weights the gspo loss (verl 0.5 applies tis_imp_ratio_cap in the
  vanilla loss).
- No straight-through KL variants (verl's "k3+" etc.), no ReMax / GPG / OPO estimators, no
  GMPO / clip-cov / kl-cov losses; the adaptive controller moves the reward penalty only (as verl's).
- Clip fractions and ppo_kl are means over the mini-batch's response tokens (verl: over micro-batches).
- GAE skips masked positions inside a response as verl's current version does; with the usual
  right-padded responses this is the same as the older unmasked recursion. The value loss aggregates
  with the actor's `loss_agg_mode` (verl's critic.loss_agg_mode defaults to it too).
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
ADV_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
POLICY_LOSSES = ("vanilla", "gspo")
SINGLETON_ADV = ("reward", "zero")


def _group_sums(x: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, sum) per group id in float64; x, group: [N].

    float64 because a float32 sum of n equal rewards is off by a few ulps, so a group whose rewards
    are all equal got a mean != its reward, a std of that round-off, and (r - mean) / (std + eps) far
    from 0 (64 samples rewarded 0.9: -0.35). A float32 reward has 24 significant bits, so the float64
    sum of up to 2**29 of them is exact and mean == r exactly."""
    x = x.double()
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = x.new_zeros(n_groups).index_add_(0, group, torch.ones_like(x))
    return count, x.new_zeros(n_groups).index_add_(0, group, x)


def _check_singleton(singleton: str) -> None:
    if singleton not in SINGLETON_ADV:
        raise ValueError(f"singleton_adv must be one of {SINGLETON_ADV}, got {singleton!r}")


def grpo_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6, singleton: str = "reward") -> torch.Tensor:
    """Outcome advantage per sample: (r - mean_group) [/ (std_group + eps)]. rewards, group: [N].
    A group of one: mean 0, std 1 (verl: the reward itself) or, with singleton="zero", 0."""
    _check_singleton(singleton)
    r = rewards.double()  # group statistics in float64: see _group_sums
    count, total = _group_sums(r, group)
    mean = total / count
    if singleton == "reward":
        mean = torch.where(count > 1, mean, torch.zeros_like(mean))
    centered = r - mean[group]
    if not norm_by_std:
        return centered.float()
    sq = r.new_zeros(count.shape).index_add_(0, group, centered**2)  # two-pass variance
    var = sq / (count - 1).clamp_min(1)  # unbiased
    std = torch.where(count > 1, var.sqrt(), torch.ones_like(var))  # verl: a group of one has std 1
    return (centered / (std[group] + eps)).float()


def rloo_advantages(rewards: torch.Tensor, group: torch.Tensor, singleton: str = "reward") -> torch.Tensor:
    """Leave-one-out: r_i - mean of the group's other samples = (n r_i - sum) / (n - 1); [N].
    A group of one: the reward itself (verl) or 0 (singleton="zero")."""
    _check_singleton(singleton)
    r = rewards.double()
    count, total = _group_sums(r, group)
    n, s = count[group], total[group]
    loo = (n * r - s) / (n - 1).clamp_min(1)
    lone = r if singleton == "reward" else torch.zeros_like(r)
    return torch.where(n > 1, loo, lone).float()


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """verl's masked_whiten (shift_mean=True): (v - mean) / sqrt(var + eps) over the masked entries,
    var unbiased (Bessel over the token count)."""
    m = mask.float()
    n = m.sum()
    mean = (values * m).sum() / n.clamp_min(1)
    var = (((values - mean) ** 2) * m).sum() / n.clamp_min(1)
    if n > 1:
        var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + eps)


def outcome_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, R] with each sample's outcome score at its last response token (verl's reward tensor)."""
    m = mask.float()
    pos = torch.arange(m.shape[-1], dtype=m.dtype)
    last = (m * (pos + 1)).argmax(-1)  # index of the last 1 (0 for an empty row, masked out later)
    out = torch.zeros_like(m)
    out[torch.arange(m.shape[0]), last] = scores.float()
    return out


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (verl's compute_reinforce_plus_plus_outcome_advantage): the discounted return of
    each response token, G_t = r_t + gamma G_{t'} with t' the next response token, whitened over all
    response tokens of the batch; [N, R], zero outside the mask. Masked positions are skipped: the
    return is carried through them unchanged (an observation span inside a multi-turn response does not
    cut the reward off from the tokens before it; past the end the return is 0) and their rewards dropped."""
    m = mask.float()
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)
    for t in reversed(range(token_rewards.shape[1])):
        step = token_rewards[:, t].float() + gamma * running
        running = torch.where(m[:, t] > 0, step, running)
        returns[:, t] = running * m[:, t]
    return masked_whiten(returns, m) * m


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                                     singleton: str = "reward") -> torch.Tensor:
    """REINFORCE++ with a baseline (verl's compute_reinforce_plus_plus_baseline_outcome_advantage):
    r - mean_group (a group of one: mean 0, or advantage 0 with singleton="zero") on every token,
    whitened over all response tokens of the batch; [N, R]."""
    centered = grpo_advantages(rewards, group, norm_by_std=False, singleton=singleton)
    m = mask.float()
    return masked_whiten(centered[:, None] * m, m) * m


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (verl's compute_gae_advantage_return): (advantages whitened over the batch's response tokens,
    returns = advantages + values before whitening), both [N, R] and zero outside the mask.

    token_rewards, values: [N, R]; values[:, t] is the critic's estimate before response token t. Past a
    response's end (mask 0) the next value is 0 and the running advantage does not leak backwards
    across masked positions (they are skipped, as verl skips observation tokens)."""
    m = mask.float()
    r, v = token_rewards.float() * m, values.float() * m
    adv = torch.zeros_like(v)
    next_v = torch.zeros(v.shape[0])
    running = torch.zeros(v.shape[0])
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        step = delta + gamma * lam * running
        # a masked position keeps what follows it: the value and advantage of the next real token
        next_v = torch.where(m[:, t] > 0, v[:, t], next_v)
        running = torch.where(m[:, t] > 0, step, running)
        adv[:, t] = running
    returns = (adv + v) * m
    return masked_whiten(adv, m) * m, returns


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor,
                        token_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """verl's token_level_rewards [N, R]: each outcome score [N] at its response's last token, minus the
    optional per-token penalty [N, R] (the KL-in-reward term, coefficient included)."""
    tok = outcome_token_rewards(scores, mask)
    if token_penalty is not None:
        tok = tok - token_penalty.float() * mask.float()
    return tok


def compute_advantages(estimator: str, scores: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
                       token_penalty: torch.Tensor | None = None, norm_by_std: bool = True, gamma: float = 1.0,
                       singleton: str = "reward") -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N] or [N, R], sequence rewards [N]) of outcome `scores` [N] minus an optional
    per-token penalty [N, R] (the KL-in-reward term, coefficient included). `gae` needs the critic's
    values: `gae_advantages` on `token_level_rewards`."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator must be one of {ADV_ESTIMATORS}, got {estimator!r}")
    if estimator == "gae":
        raise ValueError("adv_estimator='gae' needs the critic's values: gae_advantages(token_level_rewards(...))")
    tok = token_level_rewards(scores, mask, token_penalty)
    rewards = tok.sum(-1)
    if estimator == "grpo":
        return grpo_advantages(rewards, group, norm_by_std, singleton=singleton), rewards
    if estimator == "dr_grpo":
        return grpo_advantages(rewards, group, norm_by_std=False, singleton=singleton), rewards
    if estimator == "rloo":
        return rloo_advantages(rewards, group, singleton), rewards
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(tok, mask, gamma), rewards
    return reinforce_pp_baseline_advantages(rewards, group, mask, singleton), rewards


def agg_denominator(mask: torch.Tensor, mode: str, norm: float | None = None) -> float:
    """The normaliser of `agg_loss` for the full mini-batch: tokens, sequences, or sequences x `norm`
    (seq-mean-token-sum-norm; default norm: the padded length)."""
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if mode == "token-mean":
        return float(mask.sum())
    seqs = float((mask.sum(-1) > 0).sum())
    if mode == "seq-mean-token-sum-norm":
        return seqs * float(norm if norm is not None else mask.shape[-1])
    return seqs


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | None = None,
             norm: float | None = None) -> torch.Tensor:
    """Aggregate a per-token loss [N, R]. With `denominator` from the whole mini-batch, sums over
    micro-batches reproduce the mini-batch value."""
    mask = mask.to(loss.dtype)
    denom = agg_denominator(mask, mode, norm) if denominator is None else denominator
    denom = max(denom, 1.0)
    if mode == "token-mean":
        return (loss * mask).sum() / denom
    per_seq = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / denom


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(old - rollout), cap), detached (verl's tis_imp_ratio_cap)."""
    return torch.exp((old_logp - rollout_logp).detach().clamp(-20, 20)).clamp(max=cap)


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    agg_mode: str = "token-mean", denominator: float | None = None, loss_type: str = "vanilla",
                    weights: torch.Tensor | None = None, norm: float | None = None):
    """The clipped policy loss, aggregated by `agg_mode` (callers pass seq-mean-token-mean for gspo,
    as verl does). adv: [N] (broadcast over tokens) or [N, R]; weights: per-token factors [N, R] on
    the loss (truncated importance sampling) or None.

    Returns (loss, clipfrac, ppo_kl, clipfrac_lower): clipfrac is the fraction of response tokens
    where the clipped branch is active, clipfrac_lower where the dual clip is, ppo_kl = mean(old - new)."""
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {loss_type!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError("dual_clip must be > 1")
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    m = mask.to(logp.dtype)
    n = m.sum().clamp_min(1)
    log_ratio = logp - old_logp
    zero = torch.zeros((), device=logp.device)
    if loss_type == "gspo":
        seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1)
        ratio = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0))
    else:
        ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # verl clamps before exp
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipfrac = ((loss2 > loss1).to(m.dtype) * m).sum() / n
    clipfrac_lower = zero
    if dual_clip is not None and loss_type == "vanilla":
        loss3 = -adv * dual_clip
        clipfrac_lower = (((loss > loss3) & (adv < 0)).to(m.dtype) * m).sum() / n
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    if weights is not None:
        loss = loss * weights.detach()
    ppo_kl = (-log_ratio.detach() * m).sum() / n
    return agg_loss(loss, mask, agg_mode, denominator, norm), clipfrac, ppo_kl, clipfrac_lower


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float = 0.5, agg_mode: str = "token-mean", denominator: float | None = None,
               norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)); all [N, R].
    Returns (loss, vf_clipfrac: the fraction of response tokens where the clipped term is the larger)."""
    m = mask.to(vpreds.dtype)
    # clamp v itself (verl's clip_by_value): old + clamp(v - old, ±c) is often 1 ulp from an unclipped v,
    # and then "the clipped term is larger" counted tokens that were never clipped
    clipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    l1, l2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), mask, agg_mode, denominator, norm)
    clipfrac = ((l2 > l1).to(m.dtype) * m).sum() / m.sum().clamp_min(1)
    return loss, clipfrac


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token logprobs (Schulman's k1/k2/k3, abs)."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = logp - ref_logp
    if kind in ("k1", "kl"):
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio**2
    # k3: exp(ref - logp) - (ref - logp) - 1 >= 0, clamped as verl does for stability
    d = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


class AdaptiveKLController:
    """verl's AdaptiveKLController: after each step, coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon,
    with kl the step's measured KL (mean over samples of the per-token mean) and n its sample count."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim (float32)."""
    logits = logits.float()
    lp = torch.log_softmax(logits, -1)
    return -(lp.exp() * lp).sum(-1)
