"""Rollout correction: importance weights, rejection and mismatch metrics for the rollout–trainer gap
(verl's `algorithm.rollout_correction`, verl/trainer/ppo/rollout_corr_helper.py; its names and defaults).

The engine samples with its own kernels (bf16, another attention or GEMM order), so the logprobs it
returns differ from those the trainer computes for the same tokens. With log r_t = old_t − rollout_t
(old: the trainer's logprobs before the update, the PPO ratio's denominator) on response tokens:

  rollout_is="token"       w_t = min(exp(log r_t), rollout_is_threshold)                 (truncated IS; TIS)
  rollout_is="sequence"    w_t = min(exp(Σ_t log r_t), rollout_is_threshold) for every token of the sequence
  rollout_is_batch_normalize  w / mean(w): over the batch's response tokens (token) or its sequences (sequence)
  rollout_rs="token"       tokens whose exp(log r_t) lies outside [lower, upper] leave the loss (IcePop's mask)
  rollout_rs="sequence"    sequences whose exp(Σ log r_t) lies outside [lower, upper] leave the loss
  rollout_rs="geometric"   sequences whose exp(mean log r_t) lies outside [lower, upper] leave the loss
  rollout_token_veto_threshold  sequences holding a token with exp(log r_t) < veto leave the loss

upper = rollout_rs_threshold, lower = rollout_rs_threshold_lower (default 1 / upper); every exp takes its
argument clamped to ±20. The weights multiply each policy-loss term, detached (as `tis_imp_ratio_cap`,
which is rollout_is="token" with that threshold); rejection zeroes the response mask the actor's update
uses (policy loss, KL loss, entropy and their normalisers), as verl replaces its response_mask.

Where it runs. Token and sequence weights are a function of one sequence's logprobs, so the actor forms
them per micro-batch from the logprobs of its pass (on-policy, one update per rollout: old = current) in
both schedules, with no extra pass. Batch normalisation, rejection and the veto need the whole batch's
old logprobs before the update (its normalisers and mask): the step then scores them first (one scoring
pass, as verl's old_log_prob) and the fused schedule runs phased (`needs_whole_batch`).

Metrics, under verl's names with the `rollout_corr/` prefix (`correction_metrics`): the IS weights'
rollout_is_{mean,max,min,std,eff_sample_size,ratio_fraction_high,ratio_fraction_low,seq_*} and
rollout_is_batch_norm_factor; the rejection's rollout_rs_* and rollout_rs_masked_fraction /
rollout_rs_seq_masked_fraction; rollout_is_veto_fraction / rollout_is_catastrophic_token_fraction; and the
mismatch itself: kl, k3_kl, training_ppl, training_log_ppl, rollout_ppl, rollout_log_ppl, log_ppl_diff,
log_ppl_abs_diff, log_ppl_diff_max / min, ppl_ratio, chi2_token, chi2_seq.

Differences from verl: advantages are computed on the rollout's full mask (verl computes them after the
rejection; the same for the outcome estimators, which put the reward on the last token whatever the mask,
but reinforce_plus_plus and gae whiten over the tokens kept there). Statistics are over this process's
batch (data-parallel ranks hold the same whole batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")
SAFETY_BOUND = 20.0  # exp arguments are clamped to ±this


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's algorithm.rollout_correction: None turns a part off (its defaults: all off)."""

    rollout_is: str | None = None  # token | sequence
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # token | sequence | geometric
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None  # default 1 / rollout_rs_threshold
    rollout_token_veto_threshold: float | None = None

    def __post_init__(self):
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {IS_LEVELS} (or None), got {self.rollout_is!r}")
        if self.rollout_rs is not None and self.rollout_rs not in RS_LEVELS:
            raise ValueError(f"rollout_rs must be one of {RS_LEVELS} (or None), got {self.rollout_rs!r}")
        if not (0 < self.rollout_is_threshold < math.inf):
            raise ValueError(f"rollout_is_threshold must be finite and > 0, got {self.rollout_is_threshold}")
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize normalises the IS weights: it needs rollout_is")
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError("rollout_rs needs rollout_rs_threshold (the upper bound of the weights kept)")
        for name in ("rollout_rs_threshold", "rollout_rs_threshold_lower", "rollout_token_veto_threshold"):
            v = getattr(self, name)
            if v is not None and not 0 < v < math.inf:
                raise ValueError(f"{name} must be finite and > 0 (or None), got {v}")
        if self.rollout_rs is not None and not self.rs_bounds[0] <= self.rs_bounds[1]:
            raise ValueError(f"rollout_rs_threshold_lower ({self.rs_bounds[0]}) must be <= rollout_rs_threshold "
                             f"({self.rs_bounds[1]})")

    @property
    def rs_bounds(self) -> tuple[float, float]:
        """(lower, upper) of the weights rejection keeps."""
        upper = float(self.rollout_rs_threshold)
        lower = self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else float(lower)), upper

    @property
    def active(self) -> bool:
        return (self.rollout_is is not None or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)

    @property
    def needs_whole_batch(self) -> bool:
        """Whether the batch's old logprobs must be scored before the update (normaliser or mask from them)."""
        return (self.rollout_is_batch_normalize or self.rollout_rs is not None
                or self.rollout_token_veto_threshold is not None)


def _masked_mean(x: torch.Tensor, m: torch.Tensor, dim=None) -> torch.Tensor:
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1)


def _seq_log_ratio(log_ratio: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    """[N, 1]: the sum (sequence) or mean (geometric) of a sequence's log-ratios."""
    if level == "geometric":
        return _masked_mean(log_ratio, m, -1)[:, None]
    return (log_ratio * m).sum(-1)[:, None]


def _raw_weights(log_ratio: torch.Tensor, m: torch.Tensor, level: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, R] before truncation, the log-ratio they came from: [N, R] for token, [N, 1] otherwise)."""
    lr = log_ratio if level == "token" else _seq_log_ratio(log_ratio, m, level)
    return torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio), lr


def is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
               threshold: float) -> torch.Tensor:
    """The truncated IS weights [N, R] of `level` (token | sequence), 0 outside the mask, detached; no batch
    normalisation (the actor forms these per micro-batch)."""
    m = mask.to(old_logp.dtype)
    w, _ = _raw_weights((old_logp - rollout_logp).detach(), m, level)
    return (w * m).clamp(max=threshold)


def _weight_stats(prefix: str, w: torch.Tensor, lr: torch.Tensor, m: torch.Tensor, level: str, upper: float,
                  lower: float) -> dict[str, float]:
    """verl's compute_is_metrics / compute_rs_metrics: statistics of weights `w` [N, R] (for IS: before
    truncation) from log-ratios `lr` ([N, R] token, [N, 1] sequence-level), bounds [lower, upper]."""
    out = {}
    valid = m > 0
    if level == "token":
        out[f"{prefix}_max"] = float(w.masked_fill(~valid, -math.inf).max())
        out[f"{prefix}_min"] = float(w.masked_fill(~valid, math.inf).min())
        out[f"{prefix}_ratio_fraction_high"] = float(_masked_mean((w > upper).float(), m))
        out[f"{prefix}_ratio_fraction_low"] = float(_masked_mean((w < lower).float(), m))
    else:  # the sequence's log-ratio itself, for the extremes and the fractions (unclamped), as verl
        out[f"{prefix}_max"] = math.exp(min(float(lr.max()), SAFETY_BOUND))
        out[f"{prefix}_min"] = math.exp(float(lr.min()))
        out[f"{prefix}_ratio_fraction_high"] = float((lr > math.log(upper)).float().mean())
        out[f"{prefix}_ratio_fraction_low"] = float((lr < math.log(lower)).float().mean())
    out[f"{prefix}_mean"] = float(_masked_mean(w, m))
    wc = w.clamp(lower, upper)
    mean_c = _masked_mean(wc, m)
    out[f"{prefix}_std"] = float((_masked_mean(wc.square(), m) - mean_c.square()).clamp_min(0).sqrt()) \
        if float(m.sum()) > 1 else 0.0
    out[f"{prefix}_eff_sample_size"] = float(1.0 / _masked_mean((wc / (mean_c + 1e-8)).square(), m))
    seq = _masked_mean(w, m, -1)
    out[f"{prefix}_seq_mean"] = float(seq.mean())
    out[f"{prefix}_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out[f"{prefix}_seq_max"] = float(seq.max())
    out[f"{prefix}_seq_min"] = float(seq.min())
    out[f"{prefix}_seq_max_deviation"] = float((seq - 1.0).abs().max())
    out[f"{prefix}_seq_fraction_high"] = float((seq > upper).float().mean())
    out[f"{prefix}_seq_fraction_low"] = float((seq < lower).float().mean())
    return out


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's compute_offpolicy_metrics (without the prefix): KL(rollout || trainer) by k1 and k3, both
    policies' perplexities (mean over sequences of exp(−token mean logp)), their log difference and ratio, and
    the chi-square divergences of the token and sequence IS weights."""
    m = mask.to(old_logp.dtype)
    old, roll = old_logp.detach(), rollout_logp.detach()
    log_ratio = old - roll
    mean_old, mean_roll = _masked_mean(old, m, -1), _masked_mean(roll, m, -1)
    diff = mean_roll - mean_old
    seq_sum = (log_ratio * m).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-mean_old).mean()), "training_log_ppl": float((-mean_old).mean()),
        "kl": float(_masked_mean(roll - old, m)),
        "k3_kl": float(_masked_mean(torch.exp(log_ratio) - log_ratio - 1, m)),
        "rollout_ppl": float(torch.exp(-mean_roll).mean()), "rollout_log_ppl": float((-mean_roll).mean()),
        "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(_masked_mean(torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square(), m) - 1),
        "chi2_seq": float(torch.exp(2 * seq_sum).mean() - 1),
    }


def rollout_correction(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                       rc: RolloutCorrection) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's compute_rollout_correction_and_rejection_mask over a whole batch: (the IS weights [N, R],
    truncated, batch-normalised when asked, detached — None without rollout_is; the response mask with the
    rejected tokens and sequences zeroed [N, R]; the metrics, `rollout_corr/`-prefixed), on old_logp's device.
    ValueError for a batch without response tokens."""
    rollout_logp = rollout_logp.to(old_logp.device)
    m = mask.to(old_logp.device, old_logp.dtype)
    if not bool((m > 0).any()):
        raise ValueError("rollout correction needs at least one response token")
    log_ratio = (old_logp - rollout_logp).detach()
    metrics: dict[str, float] = {}
    weights = None
    if rc.rollout_is is not None:
        raw, lr = _raw_weights(log_ratio, m, rc.rollout_is)
        raw = raw * m
        t = rc.rollout_is_threshold
        metrics.update(_weight_stats("rollout_is", raw, lr, m, rc.rollout_is, t, 1.0 / t))
        weights = raw.clamp(max=t)
        if rc.rollout_is_batch_normalize:
            if rc.rollout_is == "token":
                mean = _masked_mean(weights, m)
            else:  # over sequences: each non-empty sequence's (constant) weight once
                seqs = (m.sum(-1) > 0).to(m.dtype)
                mean = (_masked_mean(weights, m, -1) * seqs).sum() / seqs.sum().clamp_min(1)
            factor = float(mean)
            if factor > 1e-8:
                weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    keep = m.clone()
    if rc.rollout_rs is not None:
        lower, upper = rc.rs_bounds
        raw, lr = _raw_weights(log_ratio, m, rc.rollout_rs)
        inside = ((raw >= lower) & (raw <= upper)).to(m.dtype)
        metrics.update(_weight_stats("rollout_rs", raw, lr, m, rc.rollout_rs, upper, lower))
        metrics["rollout_rs_masked_fraction"] = float(_masked_mean(1 - inside, m))
        if rc.rollout_rs == "token":
            metrics["rollout_rs_seq_masked_fraction"] = float((((1 - inside) * m).sum(-1) > 0).float().mean())
        else:
            metrics["rollout_rs_seq_masked_fraction"] = float((1 - inside[:, 0]).mean())
        keep = keep * inside
    veto, bad = 0.0, 0.0
    if rc.rollout_token_veto_threshold is not None:
        catastrophic = (log_ratio < math.log(rc.rollout_token_veto_threshold)) & (m > 0)
        has = catastrophic.any(-1, keepdim=True)
        veto, bad = float(has.float().mean()), float(_masked_mean(catastrophic.float(), m))
        keep = keep * (~has).to(m.dtype)
    metrics["rollout_is_veto_fraction"], metrics["rollout_is_catastrophic_token_fraction"] = veto, bad
    metrics.update(mismatch_metrics(old_logp, rollout_logp, m))
    return weights, keep, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def corrected_batch(batch, old_logp: torch.Tensor | None, cfg):
    """The batch the actor's update trains under `cfg.rollout_corr` (a RolloutBatch): where the correction needs
    the whole batch (`needs_whole_batch`) and the batch has rollout logprobs, its mask with the rejected tokens
    zeroed and its batch-normalised IS weights (`is_weights`) from the old logprobs scored before the update;
    otherwise the batch itself (the actor forms the weights per micro-batch)."""
    rc = cfg.rollout_corr
    if not rc.needs_whole_batch or batch.rollout_logprobs is None or old_logp is None:
        return batch
    weights, keep, _ = rollout_correction(old_logp, batch.rollout_logprobs, batch.mask, rc)
    dev = batch.mask.device
    return replace(batch, mask=keep.to(dev, batch.mask.dtype), is_weights=None if weights is None else weights.to(dev))
