"""GRPO / PPO math on padded [N, R] response tensors with a 0/1 `mask` (1 = a response token).

Names and conventions follow verl (core_algos.py): `compute_grpo_outcome_advantage`, PPO-clip with
an optional dual clip, KL estimators k1 / k3 (`low_var_kl`) / k2 (`mse`), and the loss aggregation
modes token-mean, seq-mean-token-mean and seq-mean-token-sum. Every function is pure tensor math,
checked against hand-computed values in tests/test_algos.py.

Aggregation with micro-batches: a loss computed on a micro-batch and divided by the *global*
normaliser (`agg_denominator` over the whole mini-batch) sums to the mini-batch loss, so gradients
do not depend on how samples were grouped into micro-batches — which is what lets the shared-prefix
(`rollplex`) and per-sample (`serial`) modes produce the same update.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl")


def grpo_advantages(rewards: torch.Tensor, group: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Outcome advantage per sample: (r - mean_group) [/ (std_group + eps)]. rewards, group: [N]."""
    rewards = rewards.float()
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = rewards.new_zeros(n_groups).index_add_(0, group, torch.ones_like(rewards))
    mean = rewards.new_zeros(n_groups).index_add_(0, group, rewards) / count
    centered = rewards - mean[group]
    if not norm_by_std:
        return centered
    var = rewards.new_zeros(n_groups).index_add_(0, group, centered**2) / (count - 1).clamp_min(1)  # unbiased
    std = torch.where(count > 1, var.sqrt(), torch.ones_like(var))  # verl: a group of one has std 1
    return centered / (std[group] + eps)


def agg_denominator(mask: torch.Tensor, mode: str) -> float:
    """The normaliser of `agg_loss` for the full mini-batch (tokens or sequences)."""
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    return float(mask.sum()) if mode == "token-mean" else float((mask.sum(-1) > 0).sum())


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | None = None) -> torch.Tensor:
    """Aggregate a per-token loss [N, R]. With `denominator` from the whole mini-batch, sums over
    micro-batches reproduce the mini-batch value."""
    mask = mask.to(loss.dtype)
    denom = agg_denominator(mask, mode) if denominator is None else denominator
    denom = max(denom, 1.0)
    if mode == "token-mean":
        return (loss * mask).sum() / denom
    per_seq = (loss * mask).sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    return per_seq.sum() / denom


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                    agg_mode: str = "token-mean", denominator: float | None = None):
    """PPO-clip (optionally dual-clip, c > 1) per-token loss, aggregated.

    adv: [N] (outcome advantage, broadcast over tokens) or [N, R]. Returns (loss, clipfrac, ppo_kl):
    clipfrac is the fraction of tokens where the clipped branch is active; ppo_kl = mean(old - new).
    """
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1")
        loss3 = -adv * dual_clip
        loss = torch.where(adv < 0, torch.minimum(loss, loss3), loss)
    m = mask.float()
    n = m.sum().clamp_min(1)
    clipfrac = (clipped * m).sum() / n
    ppo_kl = ((old_logp - logp).detach() * m).sum() / n
    return agg_loss(loss, mask, agg_mode, denominator), clipfrac, ppo_kl


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from sampled-token logprobs (Schulman's k1/k2/k3)."""
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = logp - ref_logp
    if kind in ("k1", "kl"):
        return log_ratio
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio**2
    # k3: exp(ref - logp) - (ref - logp) - 1 >= 0, clamped as verl does for stability
    d = (ref_logp - logp).clamp(-20, 20)
    return (torch.exp(d) - d - 1).clamp(-10, 10)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dim (float32)."""
    logits = logits.float()
    lp = torch.log_softmax(logits, -1)
    return -(lp.exp() * lp).sum(-1)
