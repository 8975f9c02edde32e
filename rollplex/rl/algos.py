"""RL math on padded [N, R] response tensors with a 0/1 `mask` (1 = a response token).

Names and semantics follow verl (core_algos.py); every function is pure tensor math, checked against
hand-computed values (tests/test_algos.py) and against verl's formulas re-derived on random inputs
(tests/test_algos_verl.py). docs/ALGORITHMS.md tables every option with its formula, verl name, default
and what differs from verl; the critic's part is in docs/ARCHITECTURE.md ("PPO with a critic").

    compute_advantages / gae_advantages   the estimators of `RLConfig.adv_estimator` ([N] or [N, R];
                                          group statistics in float64, so an all-equal group gets 0)
    ppo_policy_loss / agg_loss            the policy losses of `RLConfig.policy_loss`, aggregated by
                                          `loss_agg_mode` over the *whole* mini-batch's normaliser
                                          (`agg_denominator`), so micro-batching, the shared-prefix and
                                          per-sample modes and data parallelism give the same gradient
    kl_penalty / AdaptiveKLController     the KL estimators (k1/k2/k3, "+" variants) and verl's adaptive
                                          KL-in-reward coefficient (it moves the reward penalty only)
    value_loss                            verl's clipped value loss, aggregated like the policy loss
    token_level_rewards                   the outcome reward at a response's last token, minus the
                                          per-token KL penalty
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The menu: each option with what it is in a line (the flags' help is made from these, rollplex/cli.py)
AGG_MODE_HELP = {
    "token-mean": "sum of token losses / tokens of the mini-batch",
    "seq-mean-token-mean": "mean over sequences of each one's token mean",
    "seq-mean-token-sum": "mean over sequences of each one's token sum",
    "seq-mean-token-sum-norm": "mean over sequences of token sum / loss_agg_norm (Dr.GRPO)",
    "token-sum": "sum of token losses",
}
KL_HELP = {
    "k1": "logp - ref", "kl": "k1", "abs": "|logp - ref|", "k2": "(logp - ref)^2 / 2", "mse": "k2",
    "k3": "exp(ref - logp) - (ref - logp) - 1", "low_var_kl": "k3",
}
ADV_ESTIMATOR_HELP = {
    "grpo": "(r - group mean) / (group std + 1e-6)",
    "dr_grpo": "r - group mean, no std (needs --loss-agg-mode seq-mean-token-sum-norm)",
    "rloo": "leave-one-out baseline",
    "reinforce_plus_plus": "discounted per-token return, batch-whitened",
    "reinforce_plus_plus_baseline": "group mean subtracted, batch-whitened",
    "gae": "PPO with a critic (a value model trained beside the policy)",
    "opo": "length-weighted group baseline",
    "grpo_passk": "only each group's best sample, by its lead over the second (n >= 2)",
    "gpg": "group-centred, times N / non-zero rewards of the batch",
    "remax": "reward-to-go minus the reward of the prompt's greedy response, rolled out in the same call",
}
POLICY_LOSS_HELP = {
    "vanilla": "PPO-clip per token with the dual clip",
    "gspo": "sequence-level ratio clipped per sequence (verl's recipe clips at --clip-ratio-low 3e-4 "
            "--clip-ratio-high 4e-4)",
    "sapo": "soft adaptive gate instead of the clip (--tau-pos, --tau-neg)",
    "cispo": "clipped, detached IS weight times -A logp",
    "gpg": "-A logp",
    "clip_cov": "PPO-clip, high-covariance tokens' gradient cut (--clip-cov-*)",
    "kl_cov": "-A r plus a KL term on the highest-covariance tokens (--kl-cov-ratio, --ppo-kl-coef)",
    "geo_mean": "GMPO, the geometric mean of the clipped token ratios per sequence",
    "reinforce": "-A logp (verl's REINFORCE loss)",
}
AGG_MODES = tuple(AGG_MODE_HELP)
_KL_BASE = tuple(KL_HELP)
KL_KINDS = _KL_BASE + tuple(k + "+" for k in _KL_BASE)  # "+": straight-through, the gradient of k2
ADV_ESTIMATORS = tuple(ADV_ESTIMATOR_HELP)
# estimators whose advantages depend on the whole batch, not on each group alone (whitening, GPG's alpha)
BATCH_WIDE_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gpg")
POLICY_LOSSES = tuple(POLICY_LOSS_HELP)
# losses aggregated per sequence (seq-mean-token-mean) whatever loss_agg_mode says, as verl does
SEQ_LEVEL_LOSSES = ("gspo", "sapo", "geo_mean")
SINGLETON_ADV = ("reward", "zero")


def describe(options: dict[str, str]) -> str:
    """A flag's help listing every option of a menu: "name: what; name: what; ..."."""
    return "; ".join(f"{k}: {v}" for k, v in options.items())


def kl_help() -> str:
    """The KL estimators' help: the base ones, and their straight-through "+" forms."""
    return describe(KL_HELP) + "; a name with + (k1+, k3+, low_var_kl+, ...): its value with k2's gradient"


@dataclass(frozen=True)
class PolicyLossParams:
    """Hyperparameters of the losses past PPO-clip, with verl's names and defaults (actor.tau_pos / tau_neg,
    actor.policy_loss.clip_cov_* / kl_cov_ratio / ppo_kl_coef)."""

    tau_pos: float = 1.0  # sapo: the gate's temperature where A > 0
    tau_neg: float = 1.05  # sapo: where A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: the fraction of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance window (lb, ub) they are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the fraction of tokens (largest covariance) given the KL term
    ppo_kl_coef: float = 0.1  # kl_cov: that term's coefficient on |logp - old|

    def __post_init__(self):
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError("tau_pos and tau_neg must be > 0")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be within (0, 1], got {getattr(self, name)}")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError("clip_cov_lb must be < clip_cov_ub")
        if not self.ppo_kl_coef >= 0:
            raise ValueError("ppo_kl_coef must be >= 0")


def policy_agg_mode(loss_type: str, agg_mode: str) -> str:
    """The aggregation a policy loss uses: seq-mean-token-mean for the sequence-level losses (verl forces it
    for gspo and sapo; geo_mean is a mean over sequences by construction), else `agg_mode`."""
    return "seq-mean-token-mean" if loss_type in SEQ_LEVEL_LOSSES else agg_mode


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


def opo_advantages(rewards: torch.Tensor, group: torch.Tensor, lengths: torch.Tensor,
                   singleton: str = "reward") -> torch.Tensor:
    """OPO (verl's compute_opo_outcome_advantage): r - b_group with the length-weighted optimal baseline
    b = sum(len_i r_i) / sum(len_i) over the group; lengths: response tokens per sample. A group of one:
    b = 0 (verl: the reward itself) or advantage 0 (singleton="zero"); [N]."""
    _check_singleton(singleton)
    r, length = rewards.double(), lengths.double()
    count, _ = _group_sums(r, group)
    _, weighted = _group_sums(length * r, group)
    _, total_len = _group_sums(length, group)
    base = weighted / total_len.clamp_min(1)  # all-empty group: 0 / 1, the rewards are 0 too
    n = count[group]
    adv = torch.where(n > 1, r - base[group], r if singleton == "reward" else torch.zeros_like(r))
    return adv.float()


def passk_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """GRPO pass@k (verl's compute_grpo_passk_outcome_advantage): only each group's best sample gets an
    advantage, r_max - r_second_max [/ (std_group + eps), std unbiased]; the others 0. A tie for the best
    gives 0 to all. Every group needs at least 2 samples (ValueError otherwise); [N]."""
    r = rewards.double()
    count, total = _group_sums(r, group)
    if bool((count == 1).any()):
        raise ValueError("adv_estimator='grpo_passk' needs at least 2 samples per group (n >= 2)")
    n_groups, idx = count.shape[0], torch.arange(r.shape[0], device=r.device)
    best = r.new_full((n_groups,), -torch.inf).scatter_reduce(0, group, r, "amax")
    # the first sample holding the group's maximum takes the advantage
    first = torch.full((n_groups,), r.shape[0], device=r.device).scatter_reduce(
        0, group, torch.where(r == best[group], idx, r.shape[0]), "amin")
    is_best = idx == first[group]
    second = r.new_full((n_groups,), -torch.inf).scatter_reduce(
        0, group, torch.where(is_best, -torch.inf, r), "amax")
    gap = best - second
    if norm_by_std:
        centered = r - (total / count)[group]
        var = r.new_zeros(n_groups).index_add_(0, group, centered**2) / (count - 1)
        gap = gap / (var.sqrt() + eps)
    return torch.where(is_best, gap[group], torch.zeros_like(r)).float()


def gpg_advantages(rewards: torch.Tensor, group: torch.Tensor, singleton: str = "reward") -> torch.Tensor:
    """GPG (verl's compute_gpg_outcome_advantage): alpha (r - mean_group) with alpha = N / (number of
    non-zero rewards in the batch, at least 1), f_norm 1; a group of one: mean 0 (verl) or advantage 0
    (singleton="zero"). alpha makes it batch-wide; [N]."""
    centered = grpo_advantages(rewards, group, norm_by_std=False, singleton=singleton).double()
    alpha = rewards.shape[0] / max(int(torch.count_nonzero(rewards)), 1)
    return (alpha * centered).float()


def remax_advantages(token_rewards: torch.Tensor, baselines: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (verl's compute_remax_outcome_advantage): (returns - b, returns), both [N, R], with returns the
    undiscounted reward-to-go of each token and b [N] the reward of the prompt's greedy response (rolled out
    beside the samples: rl/remax.py)."""
    m = mask.float()
    returns = (token_rewards.float() * m).flip(-1).cumsum(-1).flip(-1)
    return returns - baselines.float()[:, None] * m, returns


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
                       singleton: str = "reward", baselines: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [N] or [N, R], sequence rewards [N]) of outcome `scores` [N] minus an optional
    per-token penalty [N, R] (the KL-in-reward term, coefficient included). `gae` needs the critic's
    values: `gae_advantages` on `token_level_rewards`; `remax` the reward of each sample's prompt's greedy
    response, `baselines` [N]. norm_by_std applies to grpo and grpo_passk."""
    if estimator not in ADV_ESTIMATORS:
        raise ValueError(f"adv_estimator must be one of {ADV_ESTIMATORS}, got {estimator!r}")
    if estimator == "gae":
        raise ValueError("adv_estimator='gae' needs the critic's values: gae_advantages(token_level_rewards(...))")
    if estimator == "remax" and baselines is None:
        raise ValueError("adv_estimator='remax' needs the reward of each prompt's greedy response (baselines): "
                         "roll out with the step's rollout_requests, which ask for it")
    tok = token_level_rewards(scores, mask, token_penalty)
    rewards = tok.sum(-1)
    if estimator == "remax":
        return remax_advantages(tok, baselines, mask)[0], rewards
    if estimator == "grpo":
        return grpo_advantages(rewards, group, norm_by_std, singleton=singleton), rewards
    if estimator == "dr_grpo":
        return grpo_advantages(rewards, group, norm_by_std=False, singleton=singleton), rewards
    if estimator == "rloo":
        return rloo_advantages(rewards, group, singleton), rewards
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(tok, mask, gamma), rewards
    if estimator == "opo":
        return opo_advantages(rewards, group, mask.sum(-1), singleton), rewards
    if estimator == "grpo_passk":
        return passk_advantages(rewards, group, norm_by_std), rewards
    if estimator == "gpg":
        return gpg_advantages(rewards, group, singleton), rewards
    return reinforce_pp_baseline_advantages(rewards, group, mask, singleton), rewards


def agg_denominator(mask: torch.Tensor, mode: str, norm: float | None = None) -> float:
    """The normaliser of `agg_loss` for the full mini-batch: tokens, 1 (token-sum), sequences, or sequences x
    `norm` (seq-mean-token-sum-norm; default norm: the padded length)."""
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if mode == "token-mean":
        return float(mask.sum())
    if mode == "token-sum":
        return 1.0
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
    if mode in ("token-mean", "token-sum"):
        return (loss * mask).sum() / denom
    per_seq = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / denom


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights min(exp(old - rollout), cap), detached (verl's tis_imp_ratio_cap)."""
    return torch.exp((old_logp - rollout_logp).detach().clamp(-20, 20)).clamp(max=cap)


def _frac(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The fraction of response tokens (m: [N, R] 0/1) where the boolean x [N, R] holds."""
    return (x.to(m.dtype) * m).sum() / m.sum().clamp_min(1)


def _ppo_clip(ratio, adv, m, clip_low, clip_high):
    """PPO-clip per token, max(-A r, -A clip(r, 1 - low, 1 + high)), and where the clipped branch is larger."""
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(loss1, loss2), loss2 > loss1


def _vanilla(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """PPO-clip on the token ratio (log clamped to +-20 before exp), with verl's dual clip."""
    loss, clipped = _ppo_clip(torch.exp(log_ratio.clamp(-20.0, 20.0)), adv, m, clip_low, clip_high)
    lower = torch.zeros((), device=logp.device)
    if dual_clip is not None:
        loss3 = -adv * dual_clip  # a negative-advantage token's loss is capped at c |A|
        lower = _frac((loss > loss3) & (adv < 0), m)
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    return loss, _frac(clipped, m), lower


def _gspo(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """GSPO: the sequence ratio s_i = exp(token mean of log_ratio) per token as exp(sg[log s_i] + logp -
    sg[logp]) (log clamped at 10), PPO-clipped; no dual clip."""
    seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1)  # [N]
    ratio = torch.exp((logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0))
    loss, clipped = _ppo_clip(ratio, adv, m, clip_low, clip_high)
    return loss, _frac(clipped, m), torch.zeros((), device=logp.device)


def _sapo(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """SAPO: -A f(r) with the soft gate f(r) = sigmoid(tau (r - 1)) 4 / tau in place of the clip (f'(1) = 1:
    PPO's gradient on-policy, fading smoothly off it), tau = tau_pos where A > 0, else tau_neg; r's log
    clamped to +-20. Nothing is clipped: the clip fractions are 0."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, params.tau_pos, params.tau_neg).to(ratio.dtype)
    zero = torch.zeros((), device=logp.device)
    return -adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau), zero, zero


def _cispo(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """CISPO: -sg[clip(r, 1 - low, 1 + high)] A logp: the importance weight is clipped and detached, so every
    token keeps a gradient (REINFORCE weighted by the clipped ratio); clipfrac: tokens whose r was clipped."""
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    return -weight.detach() * adv * logp, _frac(ratio != weight, m), torch.zeros((), device=logp.device)


def _reinforce(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """-A logp (verl's gpg loss and its REINFORCE loss are this same term): no ratio, no clip."""
    zero = torch.zeros((), device=logp.device)
    return -adv * logp, zero, zero


def _clip_cov(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """Clip-Cov: PPO-clip (r unclamped, as verl) where, among the tokens PPO does not clip whose centred
    covariance (A - mean A)(logp - mean logp) lies in (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio x
    tokens)) drawn at random (torch's generator, or `generator`) get no gradient (their loss is zeroed). Means
    are over this call's response tokens. clipfrac: the fraction zeroed."""
    loss, clipped = _ppo_clip(torch.exp(log_ratio), adv, m, clip_low, clip_high)
    valid = m > 0
    n = m.sum().clamp_min(1)
    lp = logp.detach()
    cov = (adv - (adv * m).sum() / n) * (lp - (lp * m).sum() / n)
    cand = (valid & ~clipped & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)).flatten().nonzero()[:, 0]
    k = max(int(params.clip_cov_ratio * float(m.sum())), 1)
    if cand.numel() > k:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:k].to(cand.device)]
    cut = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    cut[cand] = True
    cut = cut.view_as(m)
    return torch.where(cut, torch.zeros_like(loss), loss), _frac(cut, m), torch.zeros((), device=logp.device)


def _kl_cov(logp, log_ratio, adv, m, clip_low, clip_high, dual_clip, params, generator):
    """KL-Cov: the unclipped -A r (r unclamped, as verl), plus ppo_kl_coef |logp - old| on the
    max(1, int(kl_cov_ratio x tokens)) response tokens of largest covariance (A - mean A)(logp - mean logp),
    means over this call's response tokens. clipfrac: the fraction given the KL term."""
    loss = -adv * torch.exp(log_ratio)
    valid = m > 0
    pick = torch.zeros_like(valid)
    n_valid = int(valid.sum())
    if n_valid > 0:
        a, lp = adv.detach()[valid], logp.detach()[valid]  # row-major order of the response tokens
        cov = (a - a.mean()) * (lp - lp.mean())
        top = torch.topk(cov, max(1, int(n_valid * params.kl_cov_ratio))).indices
        flat = torch.zeros(n_valid, dtype=torch.bool, device=m.device)
        flat[top] = True
        pick[valid] = flat
    loss = torch.where(pick, loss + params.ppo_kl_coef * log_ratio.abs(), loss)
    return loss, _frac(pick, m), torch.zeros((), device=logp.device)


_TOKEN_LOSSES = {"vanilla": _vanilla, "gspo": _gspo, "sapo": _sapo, "cispo": _cispo, "gpg": _reinforce,
                 "reinforce": _reinforce, "clip_cov": _clip_cov, "kl_cov": _kl_cov}


def _geo_mean(log_ratio, adv, m, clip_low, clip_high, weights, denominator):
    """GMPO: per sequence, -mean_t(A) exp(mean_t(clipped log_ratio)), the log-ratio clipped towards 0 on the
    side the advantage's sign makes it grow (sgn(A) min(sgn(A) x, sgn(A) clamp(x, -low, high))); averaged
    over the non-empty sequences (or divided by `denominator`). TIS weights enter per sequence as their
    geometric mean. Returns (loss, clipfrac where A > 0, clipfrac where A < 0), clipped meaning x was
    outside [-low, high]."""
    sgn = torch.sign(adv)
    x_clip = log_ratio.clamp(-clip_low, clip_high)
    x = sgn * torch.minimum(sgn * log_ratio, sgn * x_clip)
    length = m.sum(-1).clamp_min(1)  # [N]
    per_seq = -((adv * m).sum(-1) / length) * torch.exp((x * m).sum(-1) / length)
    if weights is not None:
        per_seq = per_seq * torch.exp((torch.log(weights.detach() + 1e-10) * m).sum(-1) / length)
    denom = float((m.sum(-1) > 0).sum()) if denominator is None else denominator
    clipped = log_ratio != x_clip
    return per_seq.sum() / max(denom, 1.0), _frac(clipped & (adv > 0), m), _frac(clipped & (adv < 0), m)


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    agg_mode: str = "token-mean", denominator: float | None = None, loss_type: str = "vanilla",
                    weights: torch.Tensor | None = None, norm: float | None = None,
                    params: PolicyLossParams | None = None, generator: torch.Generator | None = None):
    """The policy loss `loss_type` (POLICY_LOSSES; the module docstring), aggregated by
    `policy_agg_mode(loss_type, agg_mode)` with `denominator` (the whole mini-batch's, for micro-batches).
    logp, old_logp, mask: [N, R]; adv: [N] (broadcast over tokens) or [N, R]; weights: per-token factors
    [N, R] on the loss (truncated importance sampling) or None; params: the hyperparameters of sapo /
    clip_cov / kl_cov (verl's defaults when None); generator: clip_cov's random draw.

    Returns (loss, clipfrac, ppo_kl, clipfrac_lower): clipfrac is the fraction of response tokens where
    the loss's clip is active (per loss: see its function), clipfrac_lower where the dual clip is (geo_mean:
    clipped with A < 0), ppo_kl = mean(old - new) over the response tokens."""
    if loss_type not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {loss_type!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError("dual_clip must be > 1")
    params = params if params is not None else PolicyLossParams()
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    m = mask.to(logp.dtype)
    log_ratio = logp - old_logp
    ppo_kl = (-log_ratio.detach() * m).sum() / m.sum().clamp_min(1)
    if loss_type == "geo_mean":
        loss, clipfrac, clipfrac_lower = _geo_mean(log_ratio, adv, m, clip_low, clip_high, weights, denominator)
        return loss, clipfrac, ppo_kl, clipfrac_lower
    loss, clipfrac, clipfrac_lower = _TOKEN_LOSSES[loss_type](logp, log_ratio, adv, m, clip_low, clip_high,
                                                              dual_clip, params, generator)
    if weights is not None:
        loss = loss * weights.detach()
    agg = agg_loss(loss, mask, policy_agg_mode(loss_type, agg_mode), denominator, norm)
    return agg, clipfrac, ppo_kl, clipfrac_lower


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
    """Per-token estimate of KL(pi || ref) from sampled-token logprobs (Schulman's k1/k2/k3, abs). A kind
    ending in "+" is straight-through: the value of the base estimator, the gradient of k2 (whose gradient
    is the unbiased one), as verl's kl_penalty."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    if kind.endswith("+"):
        value = _kl_forward(logp, ref_logp, kind[:-1])
        k2 = 0.5 * (logp - ref_logp) ** 2
        return k2 - k2.detach() + value.detach()
    return _kl_forward(logp, ref_logp, kind)


def _kl_forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """The base estimators of `kl_penalty` (kind without "+")."""
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
