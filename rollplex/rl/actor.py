"""The actor: a `PolicyLoss` (PPO/GRPO's clipped policy loss, its KL and entropy terms) trained by a
Trainer (rl/trainer.py: epochs x mini-batches, the OOM ladder, the agreed optimizer step) with the
actor's LR schedule, and its old logprobs.

    Actor.update(batch, advantages, ref, old, step, cfg)   the phased update (`Trainer.fit`)
    Actor.accumulate_groups / apply_groups                 the fused schedule's first mini-batch, group by
                                                           group beside the rollout (rl/pipeline.py)
    Actor.old_logprobs(batch, cfg)                         scored once before the first of several updates;
                                                           None with one (old = current, detached)

`update` and `old_logprobs` take the step's RLConfig (default: the actor's), so a caller can change the
algorithm for one step; a step's `lr` replaces the schedule's base lr for its optimizer steps. The LR
schedule advances per step that changed the weights (`lr_schedule_unit="step"`, verl's default) or per
applied optimizer step. Parameters are updated in place, so the engine — which reads the same tensors —
sees the new policy at the next rollout. More in docs/ARCHITECTURE.md ("The trainers").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .activation_checkpointing import set_activation_checkpointing
from .algos import agg_denominator, agg_loss, kl_penalty, policy_agg_mode, ppo_policy_loss
from .batch import RolloutBatch
from .config import RLConfig
from .errors import NonFiniteUpdate as NonFiniteUpdate  # re-exported: where callers have long found them
from .errors import TrainOOM as TrainOOM
from .microbatch import MicroBatching
from .optimizer import MasterAdamW
from .placement import Placement
from .rollout_correction import is_weights
from .scoring import logprobs, token_logprobs
from .trainer import Trainer, lr_lambda

# what to change when the update runs out of memory: inside a data-parallel pass; at the smallest micro-batch
ACTOR_DP_HINT = "lower micro_batch_prompts / micro_batch_max_tokens or turn on gradient_checkpointing"
ACTOR_HINT = ("lower n or max_new_tokens, turn on gradient_checkpointing, or offload the optimizer (optimizer_offload) "
              "or the reference model")


@dataclass
class Accumulated:
    """The first mini-batch of an update, accumulated by `accumulate_groups` beside the rollout: its
    unnormalised metrics (METRICS order), the sample rows this process trained, their logprobs [n, R]."""
    metrics: torch.Tensor
    rows: torch.Tensor
    logprobs: torch.Tensor


METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
           "actor/pg_clipfrac_lower")


class PolicyLoss:
    """The PPO/GRPO policy loss of one update's passes (a `Loss`, rl/trainer.py): the clipped policy loss of
    `cfg.policy_loss` against `advantages` [N] or [N, R], the KL to the reference's logprobs as a loss term
    (`use_kl_loss`), the entropy (a metric, a bonus with `entropy_coeff`), the rollout correction's importance
    weights (rl/rollout_correction.py: the batch's `is_weights` [N, R], or formed per pass against the rollout's
    logprobs); old logprobs [N, R] or None (old = current,
    detached). first: where each pass's logprobs are kept ((rows, logprobs [n, R]), the first epoch's).
    Without advantages it only says a mini-batch's normalisers (`norms`, `scales`)."""

    metrics = METRICS

    def __init__(self, cfg: RLConfig, advantages: torch.Tensor | None, ref_logprobs: torch.Tensor | None = None,
                 old_logprobs: torch.Tensor | None = None, rollout_logprobs: torch.Tensor | None = None,
                 first: list | None = None, is_weights: torch.Tensor | None = None):
        self.cfg, self.advantages, self.ref, self.old, self.rollout = (cfg, advantages, ref_logprobs, old_logprobs,
                                                                       rollout_logprobs)
        self.is_weights = is_weights
        self.first, self._kept = first, len(first) if first is not None else 0
        # verl aggregates GSPO's loss per sequence whatever the mode
        self.pg_mode = policy_agg_mode(cfg.policy_loss, cfg.loss_agg_mode)
        rc = cfg.rollout_corr  # IS weights (rl/rollout_correction.py): the batch's, or formed per micro-batch
        self.tis = rc.rollout_is is not None and (rollout_logprobs is not None or is_weights is not None)
        # the entropy is a metric always (verl reports it): detached from the chunked pass, and through the
        # full logits only when a bonus needs its gradient
        self.entropy = "grad" if cfg.entropy_coeff > 0 else "metric"
        self.use_kl = ref_logprobs is not None and cfg.use_kl_loss and cfg.kl_coef > 0

    def start(self) -> None:
        if self.first is not None:
            del self.first[self._kept:]

    def norms(self, mask: torch.Tensor) -> tuple[float, float, float]:
        """(loss denominator, policy-loss denominator, tokens) of a mini-batch with response mask `mask`."""
        cfg = self.cfg
        denom = agg_denominator(mask, cfg.loss_agg_mode, cfg.agg_norm)
        pg_denom = agg_denominator(mask, self.pg_mode, cfg.agg_norm)
        return denom, pg_denom, max(float(mask.sum()), 1.0)

    def scales(self, mask: torch.Tensor) -> tuple[float, list[float]]:
        """(what divides the gradients, what divides each metric) of a mini-batch accumulated unnormalised."""
        denom, pg_denom, n_tok = self.norms(mask)
        grad = 1.0 / max(pg_denom if fused_loss_norm(self.cfg) == "pg" else denom, 1.0)
        return grad, [1 / max(pg_denom, 1.0), 1 / max(denom, 1.0), 1 / max(denom, 1.0), 1 / n_tok, 1 / n_tok,
                      1 / n_tok]

    def forward(self, model: Qwen25VL, mb: RolloutBatch, mode: str, packed: bool):
        return token_logprobs(model, mb, mode, packed, self.cfg.temperature, self.entropy)

    def __call__(self, out, mb: RolloutBatch, gidx: torch.Tensor, norms: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, (logp, ent), (denom, pg_denom, n_tok) = self.cfg, out, norms
        n_all, n = mb.num_samples, gidx.shape[0]
        dev = logp.device
        mask = to_device(mb.mask, dev)
        if self.first is not None:  # kept on the device until the update ends (no sync per micro-batch)
            self.first.append((gidx, logp[:n].detach() * mask[:n]))
        old = logp.detach() if self.old is None else to_device(_rows(self.old, gidx, n_all), dev)
        adv = to_device(_rows(self.advantages, gidx, n_all), dev)
        weights = None
        if self.tis and self.is_weights is not None:
            weights = to_device(_rows(self.is_weights, gidx, n_all), dev)
        elif self.tis:
            rc = cfg.rollout_corr
            rollout = to_device(_rows(self.rollout, gidx, n_all), dev)
            weights = is_weights(old, rollout, mask, rc.rollout_is, rc.rollout_is_threshold)
        pg, clipfrac, ppo_kl, clip_lower = ppo_policy_loss(
            logp, old, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.dual_clip, self.pg_mode, pg_denom,
            cfg.policy_loss, weights, cfg.agg_norm, params=cfg.policy_loss_params)
        loss = pg
        w = float(mb.mask.sum()) / n_tok  # token share of this micro-batch, for metrics
        kl = torch.zeros((), device=dev)
        if self.use_kl:
            ref = to_device(_rows(self.ref, gidx, n_all), dev)
            kl = agg_loss(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode, denom, cfg.agg_norm)
            loss = loss + cfg.kl_coef * kl
        e = agg_loss(ent, mask, cfg.loss_agg_mode, denom, cfg.agg_norm)
        if cfg.entropy_coeff > 0:
            loss = loss - cfg.entropy_coeff * e
        return loss, torch.stack([pg.detach(), kl.detach(), e.detach(), clipfrac.detach() * w, ppo_kl.detach() * w,
                                  clip_lower.detach() * w]).float()


class Actor(Trainer):
    train_hints = (ACTOR_DP_HINT, ACTOR_HINT)
    update_name = "the actor update"

    def __init__(self, model: Qwen25VL, cfg: RLConfig, memory=None, optimizer_offload: str = "none",
                 placement: Placement | None = None, sweeps=None):
        """placement: where the passes run (default: this process; `rollplex.parallel.Colocated.place`
        gives a data-parallel one over an FSDP2-sharded model); sweeps: as `Trainer`'s (the placed policy's)."""
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        kw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        # persistent gradient buffers in the `grads` region, masters and moments in `optimizer`
        optimizer = MasterAdamW(params, memory=memory, offload=optimizer_offload, **kw)
        # the schedule's unit is the actor's (a step's config cannot change what its steps count)
        super().__init__(model, optimizer, placement, memory,
                         torch.optim.lr_scheduler.LambdaLR(optimizer.opt, lr_lambda(cfg)),
                         cfg.lr_schedule_unit == "optimizer_step", role="actor", sweeps=sweeps)
        set_activation_checkpointing(model, cfg.gradient_checkpointing, cfg.vision_gradient_checkpointing)

    @property
    def _backoff(self) -> MicroBatching | None:
        """The update's out-of-memory back-off cap (`train_backoff.cap`)."""
        return self.train_backoff.cap

    @_backoff.setter
    def _backoff(self, cap: MicroBatching | None) -> None:
        self.train_backoff.cap = cap

    def _plan(self, cfg: RLConfig) -> MicroBatching:
        """The update's micro-batching: `cfg`'s, capped by the out-of-memory back-off."""
        return self.train_backoff.plan(cfg.micro_batching)

    def set_lr(self, cfg: RLConfig, step_idx: int = 0) -> float:
        """The lr of the next optimizer step, put into the optimizer: the schedule's, with `cfg.lr` as
        its base when this step's config overrides the actor's lr."""
        lrs = self.scheduler.get_last_lr()
        if cfg.lr != self.cfg.lr:
            lrs = [cfg.lr * f(self.scheduler.last_epoch) for f in self.scheduler.lr_lambdas]
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        return lrs[0]

    def old_logprobs(self, batch: RolloutBatch, cfg: RLConfig | None = None,
                     scorer: Trainer | None = None) -> torch.Tensor | None:
        """Scored once before the first update when there are several or the rollout correction needs them for
        the whole batch (rl/rollout_correction.py); None when old = current. scorer: the trainer that scores
        them (default: this one; a runtime's `old_scorer`)."""
        cfg = cfg or self.cfg
        if cfg.num_updates == 1 and not cfg.rollout_corr.needs_whole_batch:
            return None
        return (scorer or self).score(batch, logprobs(cfg.temperature), cfg, prefix_key="old",
                                      what="the old-logprob scoring")

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
               old_all: torch.Tensor | None = None, step_idx: int = 0,
               cfg: RLConfig | None = None, nonfinite: str = "skip",
               accumulated: Accumulated | None = None) -> tuple[dict, torch.Tensor]:
        """`Trainer.fit` of the `PolicyLoss`: advantages [N] or [N, R]; ref/old logprobs [N, R] or None;
        step_idx: the step's index; cfg: this step's config (default: the actor's); accumulated: the first
        epoch's first mini-batch, already in the gradients by `accumulate_groups` (the fused schedule): it is
        normalised and applied like the others, and the update goes on with the second. Returns (verl-named
        metrics averaged over updates, the trainer's logprobs of the first pass [N, R] before any update). Under
        a data-parallel placement every rank calls it with the same arguments (but `accumulated`: its own groups' part,
        gradients already reduced) and gets the same results.

        Out of memory backs off down the ladder (`retry_oom`: halved micro-batches kept for later steps, then
        activation checkpointing, then TrainOOM with nothing changed before the first optimizer step); under a
        data-parallel placement the ranks back off together. A mini-batch whose loss or gradient norm is not
        finite gets no optimizer step: skipped (`actor/skipped_updates`, as verl) or NonFiniteUpdate with
        `nonfinite="raise"` (what the server does). Errors after an optimizer step say what was applied
        (rl/errors.py)."""
        cfg, pl = cfg or self.cfg, self.placement
        first_logp = torch.zeros(batch.responses.shape)
        seen = torch.zeros(batch.num_samples)
        first_parts: list[tuple[torch.Tensor, torch.Tensor]] = []

        def minibatch(epoch: int, done: int, mini: RolloutBatch, mini_idx: torch.Tensor) -> dict:
            loss = PolicyLoss(cfg, advantages, ref_logprobs, old_all, batch.rollout_logprobs,
                              first_parts if epoch == 0 else None, batch.is_weights)
            if accumulated is None or done > 0:
                return self.train_minibatch(cfg, mini, mini_idx, loss, step_idx)
            assert set(accumulated.rows.tolist()) <= set(mini_idx.tolist()), \
                "the groups accumulated are the first mini-batch's"
            first_parts.append((accumulated.rows, accumulated.logprobs))
            return self.stats(cfg, self.normalise(accumulated.metrics, loss, mini.mask), loss, step_idx)

        out = self.fit(cfg, batch, step_idx, minibatch, nonfinite)
        for gidx, lp in first_parts:
            first_logp[gidx] = lp.cpu()
            seen[gidx] += 1
        pl.sum_(first_logp)
        pl.sum_(seen)
        assert bool((seen == 1).all())
        return out, first_logp

    # ---- the update as a stream of groups (rl/pipeline.py) ----------------------------------
    def begin_groups(self) -> None:
        """Start accumulating one whole-batch mini-batch group by group (`accumulate_groups`)."""
        self.model.train()
        self.optimizer.zero_grad()

    def accumulate_groups(self, cfg: RLConfig, chunk: RolloutBatch, advantages: torch.Tensor,
                          ref_logprobs: torch.Tensor | None, old_logprobs: torch.Tensor | None = None,
                          placement: Placement | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward of some finished groups (`chunk`, with its own [n] / [n, R] advantages,
        reference and, with several updates, old logprobs) into the gradients, every loss term
        *unnormalised* (a unit denominator): the mini-batch's normalisers are known only when its last
        group is done (`apply_groups` or `update(accumulated=...)` divides). placement: where its passes
        run (default: the actor's; a data-parallel rank's fused stages pass its local one).
        Returns (its unnormalised metrics in METRICS order, its logprobs [n, R] on the device)."""
        first: list = []
        loss = PolicyLoss(cfg, advantages, ref_logprobs, old_logprobs, chunk.rollout_logprobs, first, chunk.is_weights)
        acc = self.accumulate(cfg, chunk, torch.arange(chunk.num_samples), loss, norms=(1.0, 1.0, 1.0), zero=False,
                              placement=placement)
        logp = torch.zeros(chunk.responses.shape, device=acc.device)
        for gidx, lp in first:
            logp[to_device(gidx, acc.device), : lp.shape[1]] = lp
        return acc, logp

    def apply_groups(self, cfg: RLConfig, acc: torch.Tensor, mask: torch.Tensor, nonfinite: str = "skip") -> dict:
        """The optimizer step of a batch accumulated by `accumulate_groups` (mask: the whole batch's [N, R]),
        as `Trainer.apply`. With several updates per rollout, `update(accumulated=...)` applies it instead."""
        return self.apply(cfg, acc, PolicyLoss(cfg, None), mask, 0, nonfinite)

    def discard_groups(self) -> None:
        """Drop what `accumulate_groups` accumulated (the step goes on another way)."""
        self.recover()
        self.model.eval()

    def state_dict(self, masters: bool = True) -> dict:
        """Optimizer (with its fp32 masters unless `masters` is False) and LR schedule."""
        return {"optimizer": self.optimizer.state_dict(masters), "scheduler": self.scheduler.state_dict()}

    def check_state_dict(self, sd) -> None:
        """ValueError unless `sd` is a state_dict this actor can load (changes nothing)."""
        if not isinstance(sd, dict) or not {"optimizer", "scheduler"} <= set(sd):
            raise ValueError("the trainer state has no optimizer / scheduler state")
        self.optimizer.check_state_dict(sd["optimizer"])
        sched = sd["scheduler"]
        base = sched.get("base_lrs") if isinstance(sched, dict) else None
        if (not isinstance(sched.get("last_epoch") if isinstance(sched, dict) else None, int)
                or sched["last_epoch"] < -1 or not isinstance(base, list)
                or len(base) != len(self.optimizer.param_groups)
                or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in base)):
            raise ValueError("the LR scheduler state is not this run's (last_epoch, base_lrs)")

    def load_state_dict(self, sd: dict, weights_dtype: torch.dtype | None = None) -> int:
        """Restore optimizer and LR schedule (the parameters already hold the checkpoint's weights); returns
        how many saved masters were rebuilt from the weights (MasterAdamW.load_state_dict)."""
        rebuilt = self.optimizer.load_state_dict(sd["optimizer"], weights_dtype)
        self.scheduler.load_state_dict(sd["scheduler"])
        return rebuilt


def fused_loss_norm(cfg: RLConfig) -> str | None:
    """Which normaliser divides every loss term of an update accumulated group by group: "loss" (the
    terms share `loss_agg_mode`'s), "pg" (only the policy loss is in it, by its own), or None when the
    terms are divided by two different ones (gspo's per-sequence policy loss beside a KL loss or an
    entropy bonus by tokens), which one division at the end cannot reproduce."""
    if policy_agg_mode(cfg.policy_loss, cfg.loss_agg_mode) == cfg.loss_agg_mode:
        return "loss"
    extra = (cfg.use_kl_loss and cfg.kl_coef > 0) or cfg.entropy_coeff > 0
    return None if extra else "pg"


def _rows(t: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """t[idx] followed by zero rows up to n rows (a placement's dummy samples in a pass)."""
    x = t[idx]
    return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])]) if n > x.shape[0] else x
