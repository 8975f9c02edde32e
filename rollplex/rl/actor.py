"""The actor: a Trainer (rl/trainer.py: epochs x mini-batches, the OOM ladder, the agreed optimizer step)
whose mini-batch is the PPO/GRPO policy loss over micro-batches, with its LR schedule.

Inside a mini-batch, micro-batches are what one forward/backward holds: in `rollplex` mode a few
prompts with all their samples, so each prompt's prefix graph (vision tower + prompt) is built and
backpropagated once for its n responses; in `serial` mode a few full sequences. Losses are normalised
by the mini-batch's token/sequence count, so both modes accumulate the same gradient. The fused
schedule accumulates the first mini-batch group by group beside the rollout (`accumulate_groups`,
`apply_groups`).

Old logprobs: with a single update per rollout the policy has not moved, so old = current
(detached) and no extra pass runs; with several updates they are scored once, before the first.

`update` and `old_logprobs` take the step's RLConfig (default: the one the actor was built with), so
a caller can change the algorithm for one step without touching the actor. The optimizer and the
LR schedule are built once from the actor's config; a step's `lr` replaces the schedule's base lr
for that step's optimizer steps.

LR schedule (`lr_schedule_unit`): "step" (verl's default) advances it once per `update` that changed
the weights — every mini-batch of a step uses the same lr, and a step that failed after writing some
weights (an applied optimizer step, or one stopped part-way) still advances it once; "optimizer_step"
advances it after each applied optimizer step (and after one that stopped part-way).

Advantages are [N] (outcome estimators) or [N, R] (per token: reinforce_plus_plus*). The policy
loss is `cfg.policy_loss` (rl/algos.py; gspo aggregates seq-mean-token-mean, as verl does), with
the rollout correction's importance weights against the batch's rollout logprobs (rl/rollout_correction.py).

Parameters are updated in place, so the engine — which reads the same tensors — sees the new
policy at the next rollout. bf16 parameters (GPU) get fp32 master weights in the optimizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .algos import agg_denominator, agg_loss, kl_penalty, policy_agg_mode, ppo_policy_loss
from .batch import RolloutBatch
from .config import RLConfig
from .errors import NonFiniteUpdate as NonFiniteUpdate  # re-exported: where callers have long found them
from .errors import TrainOOM as TrainOOM
from .errors import is_oom
from .microbatch import MicroBatching
from .optimizer import MasterAdamW
from .placement import Placement, SingleProcess
from .rollout_correction import is_weights
from .scoring import score_with_backoff, token_logprobs
from .trainer import Trainer, lr_lambda, retry_oom

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


class Actor(Trainer):
    def __init__(self, model: Qwen25VL, cfg: RLConfig, memory=None, optimizer_offload: str = "none",
                 placement: Placement | None = None):
        """placement: where the passes run (default: this process; `rollplex.parallel.DataParallelActor`
        gives a data-parallel one over an FSDP2-sharded model)."""
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        kw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        # persistent gradient buffers in the `grads` region, masters and moments in `optimizer`
        optimizer = MasterAdamW(params, memory=memory, offload=optimizer_offload, **kw)
        # the schedule's unit is the actor's (a step's config cannot change what its steps count)
        super().__init__(model, optimizer, placement or SingleProcess(), memory,
                         torch.optim.lr_scheduler.LambdaLR(optimizer.opt, lr_lambda(cfg)),
                         cfg.lr_schedule_unit == "optimizer_step", role="actor")
        self.placement.set_checkpointing(model, cfg.gradient_checkpointing, cfg.vision_gradient_checkpointing)

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

    def _set_lr(self, cfg: RLConfig) -> float:
        """The lr of the next optimizer step, put into the optimizer: the schedule's, with `cfg.lr` as
        its base when this step's config overrides the actor's lr."""
        lrs = self.scheduler.get_last_lr()
        if cfg.lr != self.cfg.lr:
            lrs = [cfg.lr * f(self.scheduler.last_epoch) for f in self.scheduler.lr_lambdas]
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        return lrs[0]

    def old_logprobs(self, batch: RolloutBatch, cfg: RLConfig | None = None) -> torch.Tensor | None:
        """Scored once before the first update when there are several or the rollout correction needs them for
        the whole batch (rl/rollout_correction.py); None when old = current."""
        cfg = cfg or self.cfg
        if cfg.num_updates == 1 and not cfg.rollout_corr.needs_whole_batch:
            return None
        return score_with_backoff(self.model, batch, cfg.mode, cfg.micro_batching, cfg.temperature, prefix_key="old",
                                  placement=self.placement, backoff=self.score_backoff, what="old-logprob")

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
               old_all: torch.Tensor | None = None, step: int = 0,
               cfg: RLConfig | None = None, nonfinite: str = "skip",
               accumulated: Accumulated | None = None) -> tuple[dict, torch.Tensor]:
        """advantages [N] or [N, R]; ref/old logprobs [N, R] or None; cfg: this step's config (default: the
        actor's); accumulated: the first epoch's first mini-batch, already in the gradients by
        `accumulate_groups` (the fused schedule): it is normalised and applied like the others, and the
        update goes on with the second. Returns (verl-named metrics averaged over updates, the trainer's
        logprobs of the first pass [N, R] before any update). Under a data-parallel placement every rank
        calls it with the same arguments (but `accumulated`: its own groups' part, gradients already
        reduced) and gets the same results.

        A micro-batch that runs out of device memory drops that mini-batch's gradients and retries it with
        halved micro-batches (kept for later steps); at one prompt (one sequence) per pass it turns on
        activation checkpointing, and after that raises TrainOOM, with the weights and optimizer untouched
        when no optimizer step had been applied. Under a data-parallel placement the ranks back off
        together from a `CollectiveOOM` (also raised for an out-of-memory error inside a pass the
        placement defers: `defer_oom`, `end_passes`); one inside a pass with other ranks waiting in its
        collectives cannot be retried and raises TrainOOM at once. Out of memory inside an optimizer step
        raises TrainOOM saying what it wrote (rl/errors.py).

        A mini-batch whose loss or gradient norm is not finite gets no optimizer step (and, per optimizer
        step, no LR-schedule step): with `nonfinite="skip"` the update goes on with the next mini-batch (counted in
        `actor/skipped_updates`, as verl skips such a step), with "raise" it raises NonFiniteUpdate
        (what the server does: the step's earlier optimizer steps, if any, are in its `applied_updates`)."""
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        cfg, pl = cfg or self.cfg, self.placement
        self.model.train()
        first_logp = torch.zeros(batch.responses.shape)
        seen = torch.zeros(batch.num_samples)
        first_parts: list[tuple[torch.Tensor, torch.Tensor]] = []

        def minibatch(epoch: int, done: int, mini: RolloutBatch, mini_idx: torch.Tensor) -> dict:
            if accumulated is not None and done == 0:
                acc = self._normalise_groups(cfg, accumulated.metrics, mini.mask)
                assert set(accumulated.rows.tolist()) <= set(mini_idx.tolist()), \
                    "the groups accumulated are the first mini-batch's"
                first_parts.append((accumulated.rows, accumulated.logprobs))
            else:
                acc = self._accumulate_retrying(cfg, mini, mini_idx, advantages, ref_logprobs, old_all,
                                                first_parts if epoch == 0 else None, batch.rollout_logprobs)
            return self._minibatch_stats(cfg, acc)

        self.applied = 0
        try:
            out = self.fit(cfg, batch, step, minibatch, nonfinite)
        except BaseException as e:
            self._end_update(self.applied, e)
            raise self.failure(e, self.applied)  # noqa: B904 - the error itself, or one caused by it
        self._end_update(self.applied)
        for gidx, lp in first_parts:
            first_logp[gidx] = lp.cpu()
            seen[gidx] += 1
        pl.sum_(first_logp)
        pl.sum_(seen)
        assert bool((seen == 1).all())
        return out, first_logp

    def _accumulate_retrying(self, cfg: RLConfig, mini: RolloutBatch, mini_idx: torch.Tensor,
                             advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
                             old_all: torch.Tensor | None, first_parts: list | None,
                             rollout_all: torch.Tensor | None) -> torch.Tensor:
        """`_accumulate` of one mini-batch down the out-of-memory ladder (`retry_oom`, see `update`); a failed
        attempt's gradients and first-pass logprobs are dropped."""
        kept = len(first_parts) if first_parts is not None else 0

        def attempt(plan: MicroBatching) -> torch.Tensor:
            if first_parts is not None:
                del first_parts[kept:]
            return self._accumulate(cfg, mini, mini_idx, advantages, ref_logprobs, old_all, first_parts, rollout_all,
                                    plan=plan)

        return retry_oom(attempt, cfg.micro_batching, cfg.mode, self.train_backoff, self.placement, self.model,
                         "the actor update", (ACTOR_DP_HINT, ACTOR_HINT), self.applied, self.recover,
                         checkpointing=True)

    def _minibatch_stats(self, cfg: RLConfig, acc: torch.Tensor) -> dict:
        """One mini-batch's metrics (summed over the placement's processes: one host sync per mini-batch), its
        gradients clipped on their global norm and the lr of its optimizer step set."""
        pl = self.placement
        stats = dict(zip(METRICS, pl.sum_(acc).tolist()))
        grad_norm = pl.clip_grad_norm_(self.optimizer.touched_params(), cfg.grad_clip)
        stats["actor/grad_norm"] = float(grad_norm)
        stats["actor/lr"] = self._set_lr(cfg)
        return stats

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
        acc = self._accumulate(cfg, chunk, torch.arange(chunk.num_samples), advantages, ref_logprobs, old_logprobs,
                               first, chunk.rollout_logprobs, norms=(1.0, 1.0, 1.0), zero=False, placement=placement)
        logp = torch.zeros(chunk.responses.shape, device=acc.device)
        for gidx, lp in first:
            logp[to_device(gidx, acc.device), : lp.shape[1]] = lp
        return acc, logp

    def apply_groups(self, cfg: RLConfig, acc: torch.Tensor, mask: torch.Tensor, nonfinite: str = "skip") -> dict:
        """The optimizer step of a batch accumulated by `accumulate_groups` (mask: the whole batch's [N, R]):
        gradients and metrics divided by the normalisers the phased update uses, then clipped and applied
        as `update` applies one mini-batch (metrics, NonFiniteUpdate, TrainOOM and the LR schedule alike).
        With several updates per rollout, `update(accumulated=...)` applies it instead."""
        acc = self._normalise_groups(cfg, acc, mask)
        self.applied = 0
        try:
            stats = self._minibatch_stats(cfg, acc)
            applied = self.apply(stats, "the batch", nonfinite)
        except BaseException as e:
            self._end_update(0, e)
            raise
        self.applied = int(applied)
        self._end_update(self.applied)
        if not applied:
            stats["actor/skipped_updates"] = 1.0
        return stats

    def _normalise_groups(self, cfg: RLConfig, acc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Divide the gradients `accumulate_groups` left by the normaliser of the mini-batch whose response
        mask is `mask` (what the phased update divides each loss term by); returns the metrics `acc`
        divided alike."""
        denom, pg_denom, n_tok = self._norms(cfg, mask)
        scale = 1.0 / max(pg_denom if fused_loss_norm(cfg) == "pg" else denom, 1.0)
        with torch.no_grad():
            for p in self.optimizer.touched_params():
                if p.grad is not None:
                    p.grad.mul_(scale)
        return acc * torch.tensor([1 / max(pg_denom, 1.0), 1 / max(denom, 1.0), 1 / max(denom, 1.0), 1 / n_tok,
                                   1 / n_tok, 1 / n_tok], device=acc.device)

    def _end_update(self, applied: int, error: BaseException | None = None) -> None:
        """After an update's optimizer steps (`applied` of them, or a failure `error`): a step that changed
        the weights, even part-way, advances a per-step LR schedule once (a per-optimizer-step one was
        advanced by `optimizer_step`); the gradients go (between updates the buffers are the memory
        manager's to release; without one they are freed); the trainer is back in eval mode."""
        if not self.per_optimizer_step and (applied > 0 or getattr(error, "partial_update", False)):
            self.scheduler.step()
        if error is not None:
            self.recover()
        else:
            self.optimizer.zero_grad(set_to_none=self.memory is None)
        self.model.eval()

    def discard_groups(self) -> None:
        """Drop what `accumulate_groups` accumulated (the step goes on another way)."""
        self.recover()
        self.model.eval()

    @staticmethod
    def _norms(cfg: RLConfig, mask: torch.Tensor) -> tuple[float, float, float]:
        """(loss denominator, policy-loss denominator, tokens) of a mini-batch with response mask `mask`."""
        denom = agg_denominator(mask, cfg.loss_agg_mode, cfg.agg_norm)
        pg_denom = agg_denominator(mask, policy_agg_mode(cfg.policy_loss, cfg.loss_agg_mode), cfg.agg_norm)
        return denom, pg_denom, max(float(mask.sum()), 1.0)

    def _accumulate(self, cfg: RLConfig, mini: RolloutBatch, mini_idx: torch.Tensor, advantages: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, old_all: torch.Tensor | None,
                    first_parts: list | None, rollout_all: torch.Tensor | None = None,
                    norms: tuple[float, float, float] | None = None, zero: bool = True,
                    placement: Placement | None = None, plan: MicroBatching | None = None) -> torch.Tensor:
        """Forward/backward of this process's share of one mini-batch's micro-batches into zeroed
        gradients; returns its part of the metrics in METRICS order (a device tensor: an .item() per
        micro-batch would make the host wait for the GPU each time and lose the run-ahead that hides
        Python/launch overhead; the caller sums it over the placement's processes).

        Every loss term is divided by the *whole mini-batch's* normaliser (`agg_denominator` over all
        processes' tokens or sequences), so summing the gradients over micro-batches and processes gives
        the mini-batch's gradient (rl/algos.py). Rows of a pass past its sample indices are a placement's
        masked-out dummies: zero advantages and reference logprobs, zero mask.

        norms: (loss, policy-loss, token) normalisers to use instead of the mini-batch's (`accumulate_groups`
        passes ones); zero: start from zeroed gradients (False: add to what is there); placement: instead of
        the actor's; plan: the micro-batching (default: the step's, capped by the update's back-off)."""
        model, pl = self.model, placement or self.placement
        plan = plan or self._plan(cfg)
        denom, pg_denom, n_tok = norms or self._norms(cfg, mini.mask)
        # verl aggregates GSPO's loss per sequence whatever the mode
        pg_mode = policy_agg_mode(cfg.policy_loss, cfg.loss_agg_mode)
        rc = cfg.rollout_corr  # IS weights (rl/rollout_correction.py): the batch's, or formed per micro-batch
        tis = rc.rollout_is is not None and (rollout_all is not None or mini.is_weights is not None)
        local, local_idx = pl.share(mini, cfg.mode)
        # the entropy is a metric always (verl reports it): detached from the chunked pass, and through the
        # full logits only when a bonus needs its gradient
        entropy = "grad" if cfg.entropy_coeff > 0 else "metric"
        use_kl = ref_logprobs is not None and cfg.use_kl_loss and cfg.kl_coef > 0
        if zero:
            self.optimizer.zero_grad()
        acc = torch.zeros(len(METRICS), device=model.inv_freq.device)
        for mb, idx in pl.passes(local, cfg.mode, plan):
            try:
                n_all, n = mb.num_samples, idx.shape[0]
                gidx = mini_idx[local_idx[idx]]  # the real samples' indices in the whole batch
                logp, ent = pl.run(model, token_logprobs, model, mb, cfg.mode, plan.packed, cfg.temperature,
                                   entropy)
                dev = logp.device
                mask = to_device(mb.mask, dev)
                if first_parts is not None:  # kept on the device until the update ends (no sync per micro-batch)
                    first_parts.append((gidx, logp[:n].detach() * mask[:n]))
                old = logp.detach() if old_all is None else to_device(_rows(old_all, gidx, n_all), dev)
                adv = to_device(_rows(advantages, gidx, n_all), dev)
                weights = None
                if tis and mini.is_weights is not None:
                    weights = to_device(_rows(mini.is_weights, local_idx[idx], n_all), dev)
                elif tis:
                    rollout = to_device(_rows(rollout_all, gidx, n_all), dev)
                    weights = is_weights(old, rollout, mask, rc.rollout_is, rc.rollout_is_threshold)
                pg, clipfrac, ppo_kl, clip_lower = ppo_policy_loss(
                    logp, old, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.dual_clip, pg_mode, pg_denom,
                    cfg.policy_loss, weights, cfg.agg_norm, params=cfg.policy_loss_params)
                loss = pg
                w = float(mb.mask.sum()) / n_tok  # token share of this micro-batch, for metrics
                kl = torch.zeros((), device=dev)
                if use_kl:
                    ref = to_device(_rows(ref_logprobs, gidx, n_all), dev)
                    kl = agg_loss(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode, denom,
                                  cfg.agg_norm)
                    loss = loss + cfg.kl_coef * kl
                e = agg_loss(ent, mask, cfg.loss_agg_mode, denom, cfg.agg_norm)
                if cfg.entropy_coeff > 0:
                    loss = loss - cfg.entropy_coeff * e
                loss.backward()
                acc += torch.stack([pg.detach(), kl.detach(), e.detach(), clipfrac.detach() * w,
                                    ppo_kl.detach() * w, clip_lower.detach() * w]).float()
            except Exception as err:  # noqa: BLE001 - only OOM is deferred
                if not (is_oom(err) and pl.defer_oom()):
                    raise
                break  # this rank's part of the mini-batch is lost: `end_passes` backs every rank off
        # a placement whose passes accumulated gradients reduces them now (or raises CollectiveOOM)
        pl.end_passes(model, lambda mb: token_logprobs(model, mb, cfg.mode, plan.packed, cfg.temperature)[0])
        return acc

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
