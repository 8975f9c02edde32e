"""The actor update: PPO/GRPO loss over micro-batches, AdamW, grad clipping, LR schedule.

One rollout is split into `ppo_mini_batches` mini-batches of whole prompt groups (each one
optimizer step) for `ppo_epochs` epochs. Inside a mini-batch, micro-batches are what one
forward/backward holds: in `rollplex` mode a few prompts with all their samples, so each prompt's
prefix graph (vision tower + prompt) is built and backpropagated once for its n responses; in
`serial` mode a few full sequences. Losses are normalised by the mini-batch's token/sequence count,
so both modes accumulate the same gradient.

Old logprobs: with a single update per rollout the policy has not moved, so old = current
(detached) and no extra pass runs; with several updates they are scored once, before the first.

`update` and `old_logprobs` take the step's RLConfig (default: the one the actor was built with), so
a caller can change the algorithm for one step without touching the actor. The optimizer and the
LR schedule are built once from the actor's config; a step's `lr` replaces the schedule's base lr
for that step's optimizer steps.

Parameters are updated in place, so the engine — which reads the same tensors — sees the new
policy at the next rollout. bf16 parameters (GPU) get fp32 master weights in the optimizer.
"""

from __future__ import annotations

import math

import torch

from ..models import Qwen25VL
from ..models.transfer import to_device
from .algos import agg_denominator, agg_loss, kl_penalty, ppo_policy_loss
from .batch import RolloutBatch
from .config import RLConfig
from .microbatch import micro_batches
from .scoring import score, token_logprobs


class MasterAdamW:
    """AdamW on fp32 master copies of low-precision parameters; copies back in place after step."""

    def __init__(self, params: list[torch.nn.Parameter], **kw):
        self.params = params
        self.master = [p.detach().float().clone().requires_grad_(True) for p in params]
        self.opt = torch.optim.AdamW(self.master, **kw)
        self.param_groups = self.opt.param_groups

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None  # the fp32 copy replaces it: no bf16 + fp32 gradient pair held at the peak
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
                m.grad = None

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "master": [m.detach().cpu() for m in self.master]}

    def load_state_dict(self, sd: dict) -> None:
        self.opt.load_state_dict(sd["opt"])
        with torch.no_grad():
            for m, s, p in zip(self.master, sd["master"], self.params):
                m.copy_(s)
                p.copy_(s)


def lr_lambda(cfg: RLConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
            t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
            return 0.5 * (1 + math.cos(math.pi * t))
        return 1.0

    return f


class Actor:
    def __init__(self, model: Qwen25VL, cfg: RLConfig):
        self.model, self.cfg = model, cfg
        params = [p for p in model.parameters() if p.requires_grad]
        kw = dict(lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.optimizer = (torch.optim.AdamW(params, **kw) if params[0].dtype == torch.float32
                          else MasterAdamW(params, **kw))
        opt = self.optimizer.opt if isinstance(self.optimizer, MasterAdamW) else self.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))

    def _mini_batches(self, cfg: RLConfig, batch: RolloutBatch, epoch: int, step: int) -> list[list[int]]:
        order = list(range(batch.num_prompts))
        if cfg.ppo_mini_batches > 1 or cfg.ppo_epochs > 1:
            g = torch.Generator().manual_seed(cfg.seed * 1000003 + step * 1009 + epoch)
            order = torch.randperm(batch.num_prompts, generator=g).tolist()
        k = cfg.ppo_mini_batches
        return [order[i::k] for i in range(k) if order[i::k]]

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
        """Scored once before the first update when there are several; None when old = current."""
        cfg = cfg or self.cfg
        if cfg.num_updates == 1:
            return None
        return score(self.model, batch, cfg.mode, cfg.micro_batching, cfg.temperature)

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
               old_all: torch.Tensor | None = None, step: int = 0,
               cfg: RLConfig | None = None) -> tuple[dict, torch.Tensor]:
        """advantages [N]; ref/old logprobs [N, R] or None; cfg: this step's config (default: the
        actor's). Returns (verl-named metrics averaged over updates, the trainer's logprobs of the
        first pass [N, R] before any update)."""
        cfg, model = cfg or self.cfg, self.model
        plan = cfg.micro_batching
        model.train()
        first_logp = torch.zeros(batch.responses.shape)
        seen = torch.zeros(batch.num_samples, dtype=torch.bool)
        first_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        sums: dict[str, float] = {}
        updates = 0
        for epoch in range(cfg.ppo_epochs):
            for prompt_ids in self._mini_batches(cfg, batch, epoch, step):
                mini, mini_idx = batch.select_prompts(sorted(prompt_ids))
                denom = agg_denominator(mini.mask, cfg.loss_agg_mode)
                self.optimizer.zero_grad()
                # metrics accumulate on the device: an .item() per micro-batch would make the host wait
                # for the GPU each time and lose the run-ahead that hides Python/launch overhead
                acc: dict[str, torch.Tensor | float] = {"actor/pg_loss": 0.0, "actor/kl_loss": 0.0,
                                                        "actor/entropy": 0.0, "actor/pg_clipfrac": 0.0,
                                                        "actor/ppo_kl": 0.0}
                n_tok = float(mini.mask.sum())
                for mb, idx in micro_batches(mini, cfg.mode, plan):
                    gidx = mini_idx[idx]
                    want_ent = cfg.entropy_coeff > 0
                    logp, ent = token_logprobs(model, mb, cfg.mode, plan.packed, cfg.temperature,
                                               with_entropy=want_ent)
                    dev = logp.device
                    mask = to_device(mb.mask, dev)
                    if epoch == 0:  # kept on the device until the update ends (no sync per micro-batch)
                        first_parts.append((gidx, logp.detach() * mask))
                        seen[gidx] = True
                    old = logp.detach() if old_all is None else to_device(old_all[gidx], dev)
                    adv = to_device(advantages[gidx], dev)
                    pg, clipfrac, ppo_kl = ppo_policy_loss(logp, old, adv, mask, cfg.clip_ratio_low,
                                                           cfg.clip_ratio_high, cfg.dual_clip, cfg.loss_agg_mode, denom)
                    loss = pg
                    w = float(mb.mask.sum()) / max(n_tok, 1.0)  # token share of this micro-batch, for metrics
                    if ref_logprobs is not None and cfg.use_kl_loss and cfg.kl_coef > 0:
                        kl = agg_loss(kl_penalty(logp, to_device(ref_logprobs[gidx], dev), cfg.kl_loss_type), mask,
                                      cfg.loss_agg_mode, denom)
                        loss = loss + cfg.kl_coef * kl
                        acc["actor/kl_loss"] = acc["actor/kl_loss"] + kl.detach()
                    if want_ent:
                        e = agg_loss(ent, mask, cfg.loss_agg_mode, denom)
                        loss = loss - cfg.entropy_coeff * e
                        acc["actor/entropy"] = acc["actor/entropy"] + e.detach()
                    loss.backward()
                    acc["actor/pg_loss"] = acc["actor/pg_loss"] + pg.detach()
                    acc["actor/pg_clipfrac"] = acc["actor/pg_clipfrac"] + clipfrac.detach() * w
                    acc["actor/ppo_kl"] = acc["actor/ppo_kl"] + ppo_kl.detach() * w
                stats = {k: float(v) for k, v in acc.items()}
                params = [p for p in model.parameters() if p.grad is not None]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                stats["actor/grad_norm"] = float(grad_norm)
                stats["actor/lr"] = self._set_lr(cfg)
                if torch.isfinite(grad_norm):
                    self.optimizer.step()
                self.scheduler.step()
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                updates += 1
        self.optimizer.zero_grad()
        model.eval()
        for gidx, lp in first_parts:
            first_logp[gidx] = lp.cpu()
        assert bool(seen.all())
        return {k: v / max(updates, 1) for k, v in sums.items()}, first_logp

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        self.scheduler.load_state_dict(sd["scheduler"])
