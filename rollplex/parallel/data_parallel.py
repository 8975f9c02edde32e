"""Data-parallel actor update over FSDP2: each rank trains its share of the rollout's prompt groups.

Every rank holds the whole RolloutBatch (the rollout's output, broadcast or generated identically)
and the same RLConfig. A mini-batch is cut exactly as `rl.actor.Actor` cuts it; its prompts (each
with all its samples: a GRPO group never straddles ranks, so its prefix is still computed once) are
dealt to ranks by token cost (`assign_prompts`), and each rank runs its share in micro-batches.

Loss normalisation: each micro-batch's loss is divided by the *whole mini-batch's* normaliser
(`agg_denominator` over every rank's tokens or sequences), FSDP sums the gradients over ranks (no
averaging, fsdp.py), so the summed gradient is the single-process step's — the same argument that
makes micro-batching exact (rl/algos.py). Metrics are summed over ranks the same way.

FSDP's collectives pair up by order, so every rank must run the same sequence of passes: the
micro-batch count is the maximum over ranks, and in pass k either every rank runs the vision tower
or none does. A rank short of passes runs a dummy one, and a rank whose pass has no image while
another rank's has gets a dummy image prompt appended; dummies carry one masked-out sample, so they
add exact zeros to the gradients (the vision tower still counts as touched exactly when some rank's
pass used it, as in the single-process step, where every image of the mini-batch is in it).

The optimizer is `rl.optimizer.MasterAdamW` over the DTensor shards (fp32 shards are their own
masters; AdamW's math is elementwise, so stepping shards equals stepping the whole tensors), with
gradient clipping on the global norm and `rl.actor`'s LR schedule. Not carried over from `Actor`: the
out-of-memory back-off and the memory manager's regions.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..models import ModelConfig, ModelInputs, Qwen25VL
from ..rl.actor import lr_lambda
from ..rl.algos import agg_denominator, agg_loss, kl_penalty, ppo_policy_loss
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.microbatch import MicroBatching, micro_batches
from ..rl.optimizer import MasterAdamW
from ..rl.scoring import token_logprobs
from .fsdp import FSDPConfig, apply_fsdp, full_tensor, sharded_call

METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl")


def prompt_costs(batch: RolloutBatch, mode: str) -> list[int]:
    """Tokens a prompt's group costs a pass: the prompt once (rollplex) or per sample (serial), plus
    its responses."""
    lens = batch.response_lengths()
    per_sample = mode != "rollplex"
    costs = [0 if per_sample else len(p.input_ids) for p in batch.prompts]
    for g, n in zip(batch.group.tolist(), lens):
        costs[g] += n + (len(batch.prompts[g].input_ids) if per_sample else 0)
    return costs


def assign_prompts(costs: list[int], world: int) -> list[list[int]]:
    """Deal prompts to `world` ranks: by decreasing cost to the least-loaded rank (ties: the lower
    rank; longest-processing-time scheduling), each rank's prompts in batch order. Deterministic, so
    every rank computes the same assignment."""
    if world < 1:
        raise ValueError("world must be >= 1")
    heap = [(0, r) for r in range(world)]
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return [sorted(x) for x in out]


def uses_vision(mb: RolloutBatch, mode: str) -> bool:
    """Whether a pass over this micro-batch runs the vision tower."""
    prompts = mb.prompts if mode == "rollplex" else [mb.prompts[g] for g in set(mb.group.tolist())]
    return any((p.pixel_values is not None and p.image_grids) or (p.pixel_values_videos is not None and p.video_grids)
               for p in prompts)


def dummy_prompt(cfg: ModelConfig, image: bool) -> ModelInputs:
    """A one-token text prompt, or a vision-start / one merged image patch / vision-end prompt."""
    if not image:
        return ModelInputs([cfg.vision_start_token_id])
    m = cfg.vision.spatial_merge_size
    return ModelInputs([cfg.vision_start_token_id, cfg.image_token_id, cfg.vision_end_token_id],
                       pixel_values=torch.zeros(m * m, cfg.vision.patch_dim), image_grid_thw=torch.tensor([[1, m, m]]))


def with_dummy(mb: RolloutBatch | None, prompt: ModelInputs) -> RolloutBatch:
    """`mb` (or nothing) plus `prompt` with one masked-out sample, appended after the real samples."""
    if mb is None:
        return RolloutBatch([prompt], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                            torch.zeros(1, 1))
    R = mb.responses.shape[1]

    def grow(t, fill=0):
        return None if t is None else torch.cat([t, torch.full((1, *t.shape[1:]), fill, dtype=t.dtype)])

    return dataclasses.replace(
        mb, prompts=[*mb.prompts, prompt], group=grow(mb.group, len(mb.prompts)),
        responses=torch.cat([mb.responses, torch.zeros(1, R, dtype=torch.long)]), mask=grow(mb.mask),
        rollout_logprobs=grow(mb.rollout_logprobs), rewards=grow(mb.rewards),
        extras={k: [*v, None] for k, v in mb.extras.items()})


def check_passes(mode: str, packed: bool) -> None:
    """ValueError for settings whose passes are not the same on every rank."""
    if mode == "rollplex" and not packed:
        # the prefix-state path runs the layers once more for the responses unless they are one token
        # long: ranks could disagree on how many times a layer is gathered and reduced
        raise ValueError("data-parallel training in rollplex mode needs packed=True (the packed pass)")


def _rows(t: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """t[idx] followed by zero rows up to n rows (the dummy samples of a pass)."""
    x = t[idx]
    return torch.cat([x, x.new_zeros(n - x.shape[0], *x.shape[1:])]) if n > x.shape[0] else x


class DataParallel:
    """The rank's place in the data-parallel mesh and the pass alignment every FSDP'd model shares."""

    def __init__(self, mesh: DeviceMesh, model_cfg: ModelConfig):
        self.mesh, self.model_cfg = mesh, model_cfg
        self.group = mesh.get_group()
        self.rank, self.world = mesh.get_local_rank(), mesh.size()
        # where this group's collectives take their tensors (NCCL: the rank's GPU)
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)

    def local_share(self, batch: RolloutBatch, mode: str) -> tuple[RolloutBatch, torch.Tensor]:
        """This rank's prompts of `batch` with all their samples, and the samples' indices in `batch`."""
        return batch.select_prompts(assign_prompts(prompt_costs(batch, mode), self.world)[self.rank])

    def passes(self, local: RolloutBatch, mode: str, plan: MicroBatching) -> list[tuple[RolloutBatch, torch.Tensor]]:
        """This rank's micro-batches (samples indexed into `local`), padded with dummies so that every
        rank runs the same number of passes and the vision tower in the same ones. A collective."""
        mbs = list(micro_batches(local, mode, plan)) if local.num_samples else []
        count = torch.tensor([len(mbs)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
        K = int(count)
        flags = torch.zeros(K, dtype=torch.long)
        flags[: len(mbs)] = torch.tensor([uses_vision(mb, mode) for mb, _ in mbs], dtype=torch.long)
        flags = flags.to(self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        flags = flags.cpu()
        out = []
        for k in range(K):
            need = bool(flags[k])
            if k >= len(mbs):
                out.append((with_dummy(None, dummy_prompt(self.model_cfg, need)), torch.zeros(0, dtype=torch.long)))
                continue
            mb, idx = mbs[k]
            if need and not uses_vision(mb, mode):
                mb = with_dummy(mb, dummy_prompt(self.model_cfg, True))
            out.append((mb, idx))
        return out

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place (through the collective's device when t is elsewhere)."""
        x = t.to(self.device)
        dist.all_reduce(x, group=self.group)
        if x is not t:
            t.copy_(x)
        return t


@torch.no_grad()
def dp_score(model: Qwen25VL, dp: DataParallel, batch: RolloutBatch, mode: str, plan: MicroBatching,
             temperature: float = 1.0) -> torch.Tensor:
    """`rl.scoring.score` over an FSDP'd model: each rank scores its share; [N, R] on every rank."""
    check_passes(mode, plan.packed)
    out = torch.zeros(batch.responses.shape, dtype=torch.float32)
    local, local_idx = dp.local_share(batch, mode)
    for mb, idx in dp.passes(local, mode, plan):
        lp, _ = sharded_call(model, token_logprobs, model, mb, mode, plan.packed, temperature)
        n = idx.shape[0]
        out[local_idx[idx]] = (lp[:n] * mb.mask[:n].to(lp.device)).float().cpu()
    return dp.sum_(out)


class DataParallelActor:
    """`rl.actor.Actor`'s update (same loss, mini-batches, clipping, schedule, metrics and returned
    logprobs) with the model sharded by FSDP2 over `mesh` and the prompts dealt over its ranks."""

    def __init__(self, model: Qwen25VL, cfg: RLConfig, mesh: DeviceMesh, fsdp: FSDPConfig | None = None):
        check_passes(cfg.mode, cfg.packed)
        fsdp = fsdp or FSDPConfig(activation_checkpointing=cfg.gradient_checkpointing,
                                  vision_activation_checkpointing=cfg.vision_gradient_checkpointing)
        self.model, self.cfg = apply_fsdp(model, mesh, fsdp), cfg
        self.dp = DataParallel(mesh, model.cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = MasterAdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer.opt, lr_lambda(cfg))

    def _mini_batches(self, cfg: RLConfig, batch: RolloutBatch, epoch: int, step: int) -> list[list[int]]:
        """The same split (and shuffle) as `Actor`'s: mini-batch i is the same prompts on every rank."""
        order = list(range(batch.num_prompts))
        if cfg.ppo_mini_batches > 1 or cfg.ppo_epochs > 1:
            g = torch.Generator().manual_seed(cfg.seed * 1000003 + step * 1009 + epoch)
            order = torch.randperm(batch.num_prompts, generator=g).tolist()
        k = cfg.ppo_mini_batches
        return [order[i::k] for i in range(k) if order[i::k]]

    def _set_lr(self, cfg: RLConfig) -> float:
        lrs = self.scheduler.get_last_lr()
        if cfg.lr != self.cfg.lr:
            lrs = [cfg.lr * f(self.scheduler.last_epoch) for f in self.scheduler.lr_lambdas]
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        return lrs[0]

    def old_logprobs(self, batch: RolloutBatch, cfg: RLConfig | None = None) -> torch.Tensor | None:
        cfg = cfg or self.cfg
        if cfg.num_updates == 1:
            return None
        return dp_score(self.model, self.dp, batch, cfg.mode, cfg.micro_batching, cfg.temperature)

    def update(self, batch: RolloutBatch, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None,
               old_all: torch.Tensor | None = None, step: int = 0,
               cfg: RLConfig | None = None) -> tuple[dict, torch.Tensor]:
        """As `Actor.update`, called on every rank with the same arguments; returns the same metrics and
        first-pass logprobs [N, R] on every rank."""
        cfg, model = cfg or self.cfg, self.model
        check_passes(cfg.mode, cfg.packed)
        model.train()
        first_logp = torch.zeros(batch.responses.shape)
        seen = torch.zeros(batch.num_samples)
        sums: dict[str, float] = {}
        updates = 0
        try:
            for epoch in range(cfg.ppo_epochs):
                for prompt_ids in self._mini_batches(cfg, batch, epoch, step):
                    mini, mini_idx = batch.select_prompts(sorted(prompt_ids))
                    acc = self._accumulate(cfg, mini, mini_idx, advantages, ref_logprobs, old_all,
                                           (first_logp, seen) if epoch == 0 else None)
                    stats = dict(zip(METRICS, self.dp.sum_(acc).tolist()))
                    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.optimizer.touched_params(),
                                                                           cfg.grad_clip))
                    stats["actor/grad_norm"] = float(grad_norm)
                    stats["actor/lr"] = self._set_lr(cfg)
                    if torch.isfinite(grad_norm):
                        self.optimizer.step()
                    self.scheduler.step()
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    updates += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            model.eval()
        self.dp.sum_(first_logp)
        self.dp.sum_(seen)
        assert bool((seen == 1).all())
        return {k: v / max(updates, 1) for k, v in sums.items()}, first_logp

    def _accumulate(self, cfg: RLConfig, mini: RolloutBatch, mini_idx: torch.Tensor, advantages: torch.Tensor,
                    ref_logprobs: torch.Tensor | None, old_all: torch.Tensor | None,
                    first: tuple | None) -> torch.Tensor:
        """Forward/backward of this rank's share of one mini-batch into zeroed gradients; returns this
        rank's part of the metrics (summed over ranks by the caller), in METRICS order."""
        model, plan = self.model, cfg.micro_batching
        denom = agg_denominator(mini.mask, cfg.loss_agg_mode)  # the whole mini-batch's, on every rank
        n_tok = max(float(mini.mask.sum()), 1.0)
        local, local_idx = self.dp.local_share(mini, cfg.mode)
        want_ent = cfg.entropy_coeff > 0
        use_kl = ref_logprobs is not None and cfg.use_kl_loss and cfg.kl_coef > 0
        acc = torch.zeros(len(METRICS))
        self.optimizer.zero_grad()
        for mb, idx in self.dp.passes(local, cfg.mode, plan):
            n_all, n = mb.num_samples, idx.shape[0]
            gidx = mini_idx[local_idx[idx]]  # the real samples' indices in the whole batch
            logp, ent = sharded_call(model, token_logprobs, model, mb, cfg.mode, plan.packed, cfg.temperature,
                                     want_ent)
            dev = logp.device
            mask = mb.mask.to(dev)
            if first is not None:
                first[0][gidx] = (logp[:n].detach() * mask[:n]).cpu()
                first[1][gidx] += 1
            old = logp.detach() if old_all is None else _rows(old_all, gidx, n_all).to(dev)
            adv = _rows(advantages, gidx, n_all).to(dev)
            pg, clipfrac, ppo_kl = ppo_policy_loss(logp, old, adv, mask, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                                   cfg.dual_clip, cfg.loss_agg_mode, denom)
            loss = pg
            w = float(mb.mask.sum()) / n_tok
            kl = e = torch.zeros((), device=dev)
            if use_kl:
                kl = agg_loss(kl_penalty(logp, _rows(ref_logprobs, gidx, n_all).to(dev), cfg.kl_loss_type), mask,
                              cfg.loss_agg_mode, denom)
                loss = loss + cfg.kl_coef * kl
            if want_ent:
                e = agg_loss(ent, mask, cfg.loss_agg_mode, denom)
                loss = loss - cfg.entropy_coeff * e
            loss.backward()
            acc += torch.stack([pg.detach(), kl.detach(), e.detach(), clipfrac.detach() * w,
                                ppo_kl.detach() * w]).float().cpu()
        return acc
