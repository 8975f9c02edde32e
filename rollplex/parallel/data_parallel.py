"""Data-parallel scoring and training over FSDP2: each rank computes its share of the prompt groups.

`DataParallel` is a placement (rl/placement.py): every `rl.trainer.Trainer` (the actor's `PolicyLoss`,
the critic's `ValueLoss`, scoring) runs its one loop over it, so the data-parallel update is the
single-process update with a placement's operations swapped, not a second implementation.
`DataParallelActor` / `DataParallelCritic` are the actor and critic over an FSDP2-sharded model with it.

Every rank holds the whole RolloutBatch and RLConfig; a mini-batch is cut as on one process and its
prompts (each with all its samples) are dealt to ranks by token cost (`assign_prompts`). Each loss is
divided by the whole mini-batch's normaliser and FSDP sums the gradients over ranks, so the summed
gradient is the single-process step's. FSDP's collectives pair up by order, so every rank runs the same
passes: short ranks run masked-out dummies (exact zeros). Out of memory is agreed before a mini-batch's
first pass (`fits`) or, with the passes gathered and reduced once, after its last (`on_oom`,
`end_passes`): every rank raises `CollectiveOOM` together and backs off alike. The fused schedule's
passes run past FSDP2's hooks on units gathered before the rollout (`begin_local`, `LocalPasses`,
`end_local`). More in docs/PARALLEL.md ("Data-parallel training").
"""

from __future__ import annotations

import dataclasses
import heapq

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..memory import activation_bytes
from ..models import ModelConfig, ModelInputs, Qwen25VL
from ..rl.activation_checkpointing import activation_checkpointing
from ..rl.actor import Actor
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.critic import Critic, ValueModel
from ..rl.microbatch import MicroBatching, micro_batches
from ..rl.placement import CollectiveOOM, SingleProcess, in_batch
from . import fsdp as fsdp_mod
from .fsdp import FSDPConfig, apply_fsdp, local_tensor, sharded_call


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
    """Whether a pass over this micro-batch runs the vision tower (prompts carrying their vision
    encodings skip it)."""
    prompts = mb.prompts if mode == "rollplex" else [mb.prompts[g] for g in set(mb.group.tolist())]
    return any(p.vision_embeds is None and ((p.pixel_values is not None and p.image_grids)
                                            or (p.pixel_values_videos is not None and p.video_grids))
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


class DataParallel:
    """The rank's place in the data-parallel mesh, as a placement of scoring and the update
    (rl/placement.py) over models `apply_fsdp` sharded on that mesh."""

    def __init__(self, mesh: DeviceMesh, model_cfg: ModelConfig, dtype_bytes: int = 4, fsdp: FSDPConfig | None = None):
        """dtype_bytes: bytes per element of the layers' compute dtype (the activation estimate); fsdp:
        the sharded models' settings (whether training passes reduce every pass or per mini-batch)."""
        self.mesh, self.model_cfg, self.dtype_bytes = mesh, model_cfg, dtype_bytes
        self.fsdp = fsdp or FSDPConfig()
        # a sharded model's gathered parameters, and those with the unsharded gradients (set by the actor)
        self.gathered_bytes = self.unsharded_bytes = 0
        self._scoring_left = 0  # no-grad passes of the current scoring call not yet run
        self._kept: Qwen25VL | None = None  # a model whose units stay gathered through a scoring call's passes
        self._left = self._first = 0  # training passes of the current mini-batch: not yet run, in all
        self._accumulate = False  # the current mini-batch's passes reduce once, after its last
        self._began = False  # its units are gathered and its passes accumulate
        self._failed = False  # one of its passes ran out of memory here (deferred to `end_passes`)
        self._open = False  # a mini-batch's passes accumulate unsharded gradients
        self._reduces = [0, 0]  # multi-pass training mini-batches reduced once / after every pass
        self.group = mesh.get_group()
        self.rank, self.world = mesh.get_local_rank(), mesh.size()
        # where this group's collectives take their tensors (NCCL: the rank's GPU)
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device(mesh.device_type)
        self.model: Qwen25VL | None = None  # the model whose passes these are (`placed`)

    def share(self, batch: RolloutBatch, mode: str) -> tuple[RolloutBatch, torch.Tensor]:
        """This rank's prompts of `batch` with all their samples, and the samples' indices in `batch`."""
        return batch.select_prompts(assign_prompts(prompt_costs(batch, mode), self.world)[self.rank])

    def passes(self, batch: RolloutBatch, mode: str, plan: MicroBatching, prefix: bool = False,
               prompts: list[int] | None = None) -> list[tuple[RolloutBatch, torch.Tensor]]:
        """This rank's micro-batches of its share of `batch` (`prompts`: these prompts instead), each with its
        real samples' indices in `batch` (see `_passes`)."""
        local, local_idx = self.share(batch, mode) if prompts is None else batch.select_prompts(prompts)
        return list(in_batch(local_idx, self._passes(local, mode, plan, prefix)))

    def _passes(self, local: RolloutBatch, mode: str, plan: MicroBatching,
                prefix: bool = False) -> list[tuple[RolloutBatch, torch.Tensor]]:
        """This rank's micro-batches (samples indexed into `local`), padded with dummies so that every
        rank runs the same number of passes and the vision tower in the same ones. A collective; in
        training (autograd on) it raises CollectiveOOM on every rank when some rank's passes would not
        fit its device. prefix: the passes read the rollout's prefix states, so none runs the tower
        (the dummies, which have none, run a one-token text prompt through the same units)."""
        check_passes(mode, plan.packed)
        mbs = list(micro_batches(local, mode, plan)) if local.num_samples else []
        grad = torch.is_grad_enabled()
        misfit = self.world > 1 and grad and not all(self.fits(mb, mode) for mb, _ in mbs)
        # over several ranks the unsharded copy is counted with a quarter more (allocator fragmentation):
        # a misjudged fit costs a back-off of every rank there
        copy = self.unsharded_bytes * (1.0 if self.world == 1 else 1.25)
        no_accumulate = self.fsdp.reduce_every_pass is None and grad and not all(
            self.fits(mb, mode, int(copy)) for mb, _ in mbs)
        # scoring: the units stay gathered from the first pass to the last when a gathered copy fits
        no_keep = not grad and not all(self.fits(mb, mode, int(self.gathered_bytes * 1.25)) for mb, _ in mbs)
        # a pass over prefix states whose responses are all one token runs no layer: with units gathered per
        # pass that would leave its rank's collectives a pass behind the others', so such a call keeps them
        one_token = prefix and any(max(mb.response_lengths()) <= 1 for mb, _ in mbs)
        K, misfit, no_accumulate, no_keep, one_token = self._max_over_ranks(
            [len(mbs), int(misfit), int(no_accumulate), int(no_keep), int(one_token)])
        no_keep = no_keep and not one_token
        self._release_kept()  # a scoring call that stopped short of its last pass
        self._scoring_left = 0 if grad or no_keep or (K < 2 and not one_token) else K
        if misfit:
            raise CollectiveOOM("a data-parallel rank's micro-batch would not fit its device memory")
        every = self.fsdp.reduce_every_pass
        # a mini-batch of one pass too: an OOM inside its pass is then deferred like any other's rather
        # than fatal
        self._accumulate = grad and K >= 1 and (every is False or (every is None and not no_accumulate))
        if grad and K > 1:
            self._reduces[0 if self._accumulate else 1] += 1
        flags = [int(not prefix and uses_vision(mb, mode)) for mb, _ in mbs] + [0] * (K - len(mbs))
        flags = self._max_over_ranks(flags) if K else []
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
        self._left = self._first = K if torch.is_grad_enabled() else 0
        self._began = self._failed = False
        return out

    def fits(self, mb: RolloutBatch, mode: str, extra: int = 0) -> bool:
        """Whether a training pass over `mb` (and `extra` more bytes) is expected to fit this rank's
        device: the memory plan's activation estimate (memory/config.py) against the free and
        cached-unused device memory. Always on CPU."""
        if self.device.type != "cuda":
            return True
        t = self.model_cfg.text
        need = extra + activation_bytes(t.hidden_size, t.num_hidden_layers, sum(prompt_costs(mb, mode)),
                                        self.dtype_bytes,
                                        self.model is not None and activation_checkpointing(self.model)[0])
        free = torch.cuda.mem_get_info(self.device)[0]
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return need <= free + cached

    def run(self, model: Qwen25VL, fn, *args):
        direct = fsdp_mod.can_call_directly(self.fsdp)
        if self._scoring_left > 0 and not torch.is_grad_enabled():  # a scoring pass, units kept gathered
            if self._kept is None:
                self._kept = model
                fsdp_mod.keep_gathered(model, True, self.fsdp)
                if direct:
                    fsdp_mod.gather_all(model)
            self._scoring_left -= 1
            out = (fsdp_mod.direct_call if direct else sharded_call)(model, fn, *args)
            if self._scoring_left == 0:
                self._release_kept()
            return out
        if self._left > 0 and torch.is_grad_enabled():  # a training pass
            if self._open and self._left == self._first:  # the last mini-batch stopped short of its reduce
                fsdp_mod.drop_unsharded_grads(model)
                fsdp_mod.set_accumulating(model, False, self.fsdp)
                self._open = False
            self._left -= 1
            if self._accumulate and not self._began:
                # every unit gathered before the first pass: the passes then run no collective, so an
                # out-of-memory error inside one leaves no other rank waiting (`on_oom`)
                fsdp_mod.set_accumulating(model, True, self.fsdp)
                self._open = True
                fsdp_mod.gather_all(model)
                self._began = True
            if self._accumulate and direct:  # the units stay gathered: no hook has anything to do
                return fsdp_mod.direct_call(model, fn, *args)
        return sharded_call(model, fn, *args)

    def on_oom(self) -> str:
        """What an out-of-memory error means here: inside a training pass whose mini-batch's passes run no
        collective (gradients reduced once, after them) it waits for `end_passes` ("defer"; this rank then
        runs no more passes of the mini-batch); else a group of one retries it and a larger one cannot (its
        other ranks wait in the pass's collectives)."""
        if self._accumulate and self._began:
            self._failed = True
            return "defer"
        return "retry" if self.world == 1 else "raise"

    def end_passes(self, model: Qwen25VL, forward) -> None:
        """After a mini-batch's passes: where they accumulated unsharded gradients, every rank learns
        whether some rank's pass ran out of memory (one all-reduce). If one did, every rank drops its
        gradients and raises CollectiveOOM, so all back off together; otherwise the gradients are
        reduce-scattered into the shards: past FSDP2's hooks where the passes were (`reduce_gathered`),
        or by one more pass through them, over a one-token dummy prompt with a zero loss (`forward(mb)`
        returns its logprobs), whose backward adds exact zeros and reduces every unit."""
        if not (self._accumulate and self._began):
            return
        direct = fsdp_mod.can_call_directly(self.fsdp)
        # with the passes past the hooks, which gradients exist on some rank rides on the same collective
        present = [int(g is not None) for g in fsdp_mod.gathered_grads(model)] if direct else []
        flags = self._max_over_ranks([int(self._failed), *present], torch.uint8)
        self._began = False
        if flags[0]:
            fsdp_mod.drop_unsharded_grads(model)
            fsdp_mod.set_accumulating(model, False, self.fsdp)
            self._open = False
            raise CollectiveOOM("a data-parallel rank ran out of device memory inside a pass of the mini-batch")
        if direct:  # reduce-scattered directly, one collective per unit
            fsdp_mod.reduce_gathered(model, [bool(x) for x in flags[1:]], self.group)
            fsdp_mod.set_accumulating(model, False, self.fsdp)
        else:  # the hooks hold the gradients (in the reduce dtype): their own reduce, in one more pass
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            dummy = with_dummy(None, dummy_prompt(self.model_cfg, False))
            (sharded_call(model, forward, dummy).sum() * 0.0).backward()
        fsdp_mod.keep_gathered(model, False, self.fsdp)  # each unit back to its own resharding, freed
        self._open = False

    # ---- the fused schedule: each rank's own groups at its own pace (rl/pipeline.py) ---------------------
    def begin_local(self, trainer: Qwen25VL, scorers: list[Qwen25VL]) -> None:
        """Every unit of the trainer and of the sharded `scorers` (the reference) gathered and kept so, the
        trainer's gradients accumulated unsharded: a collective at the same point on every rank, after
        which passes over this rank's groups alone (`LocalPasses`) run none until `end_local`."""
        fsdp_mod.set_accumulating(trainer, True, self.fsdp)
        fsdp_mod.gather_all(trainer)
        for m in scorers:
            fsdp_mod.keep_gathered(m, True, self.fsdp)
            fsdp_mod.gather_all(m)

    def end_local(self, trainer: Qwen25VL, scorers: list[Qwen25VL], flags: list[int]) -> list[int]:
        """After every rank's local passes: one all-reduce agrees `flags` (their maximum over the ranks:
        a fused stage failed somewhere) and which trainer gradients exist on some rank. Unless a flag is
        set, the gradients are reduce-scattered into the shards (summed over the ranks, as one
        mini-batch's reduce: `end_passes`); otherwise they are dropped. Every unit is resharded and freed.
        Returns the flags agreed."""
        for m in scorers:
            fsdp_mod.keep_gathered(m, False, self.fsdp)
        present = [int(g is not None) for g in fsdp_mod.gathered_grads(trainer)]
        agreed = self._max_over_ranks([*flags, *present], torch.uint8)
        flags, present = agreed[: len(flags)], agreed[len(flags):]
        if any(flags):
            fsdp_mod.drop_unsharded_grads(trainer)
            fsdp_mod.set_accumulating(trainer, False, self.fsdp)
        else:
            fsdp_mod.reduce_gathered(trainer, [bool(x) for x in present], self.group)
            fsdp_mod.set_accumulating(trainer, False, self.fsdp)
            fsdp_mod.keep_gathered(trainer, False, self.fsdp)
        return flags

    def abort_local(self, trainer: Qwen25VL, scorers: list[Qwen25VL]) -> None:
        """What `begin_local` set up, undone on this rank alone (no collective): a failed rollout."""
        for m in scorers:
            fsdp_mod.keep_gathered(m, False, self.fsdp)
        fsdp_mod.drop_unsharded_grads(trainer)
        fsdp_mod.set_accumulating(trainer, False, self.fsdp)

    def _max_over_ranks(self, values: list[int], dtype: torch.dtype = torch.long) -> list[int]:
        """Each value's maximum over the ranks: one all-reduce, and a host sync to read it. A group of one
        has nothing to agree on: no collective and no sync, so the host runs ahead of the device there
        as on one process."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=dtype, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def take_metrics(self) -> dict[str, float]:
        """The share of the training mini-batches of several passes since the last call whose gradients
        were reduced once (`reduce_every_pass`), and the counters reset."""
        once, every = self._reduces
        self._reduces = [0, 0]
        return {"perf/fsdp_reduced_once": once / (once + every)} if once + every else {}

    def _release_kept(self) -> None:
        if self._kept is not None:
            fsdp_mod.keep_gathered(self._kept, False, self.fsdp)
            self._kept = None

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the ranks, in place (through the collective's device when t is elsewhere)."""
        if self.world == 1:
            return t
        x = t.to(self.device)
        dist.all_reduce(x, group=self.group)
        if x is not t:
            t.copy_(x)
        return t

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """torch's clip_grad_norm_ over the whole model, computed on the local shards: FSDP2's Shard(0)
        rows are disjoint over the ranks, so the squared norm is the sum of the ranks' squared local
        norms (one all-reduce). The DTensor version dispatches every foreach op through sharding
        propagation over hundreds of gradients, host time that stalls the device at every mini-batch."""
        grads = [local_tensor(p.grad) for p in params if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            sq = torch.stack(norms).square().sum().to(self.device)
        if self.world > 1:
            dist.all_reduce(sq, group=self.group)
        total = sq.sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for gs in by_dtype.values():
            torch._foreach_mul_(gs, coef.to(gs[0].device))
        return total


class LocalPasses(SingleProcess):
    """The placement of one rank's fused stages (between `DataParallel.begin_local` and `end_local`): this
    rank's groups alone, in the micro-batches one process plans (SingleProcess's), through the gathered
    units past FSDP2's hooks (`direct_call`). No collective: each rank goes at its own rollout's pace."""

    def run(self, model: Qwen25VL, fn, *args):
        if not isinstance(model, fsdp_mod.FSDPModule):  # a model held whole (the policy, a reference not sharded)
            return fn(*args)
        return fsdp_mod.direct_call(model, fn, *args)

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        raise AssertionError("the fused stages accumulate; the data-parallel placement clips")


def placed(model, mesh: DeviceMesh, fsdp: FSDPConfig, column_sharded=()) -> tuple:
    """(`model` sharded in place by FSDP2 over `mesh` with `fsdp` unless it is already, the `DataParallel`
    placement of its passes): a trained model on a data-parallel group."""
    dtype = fsdp_mod.DTYPES.get(fsdp.param_dtype) or next(model.parameters()).dtype
    dp = DataParallel(mesh, model.cfg, torch.empty((), dtype=dtype).element_size(), fsdp)
    if not isinstance(model, fsdp_mod.FSDPModule):
        model = apply_fsdp(model, mesh, fsdp, column_sharded)
    dp.model = model
    # what reducing once per mini-batch holds: every parameter gathered, every trained one's gradient
    # unsharded (in the reduce dtype where one is set)
    grad_bytes = torch.empty((), dtype=fsdp_mod.DTYPES.get(fsdp.reduce_dtype) or dtype).element_size()
    dp.unsharded_bytes = sum(p.numel() * (dp.dtype_bytes + (grad_bytes if p.requires_grad else 0))
                             for p in model.parameters())
    dp.gathered_bytes = sum(p.numel() for p in model.parameters()) * dp.dtype_bytes
    return model, dp


def shard(model, cfg: RLConfig, mesh: DeviceMesh, fsdp: FSDPConfig | None = None, column_sharded=()) -> tuple:
    """(`model` sharded in place by FSDP2 over `mesh` unless it is already, `cfg` with the checkpointing it
    or `fsdp` asks for, the `DataParallel` placement over it): what a data-parallel trainer (the actor's, a
    critic's) is built on."""
    check_passes(cfg.mode, cfg.packed)
    fsdp = fsdp or FSDPConfig()
    cfg = dataclasses.replace(
        cfg, gradient_checkpointing=cfg.gradient_checkpointing or fsdp.activation_checkpointing,
        vision_gradient_checkpointing=cfg.vision_gradient_checkpointing or fsdp.vision_activation_checkpointing)
    fsdp = dataclasses.replace(fsdp, activation_checkpointing=cfg.gradient_checkpointing,
                               vision_activation_checkpointing=cfg.vision_gradient_checkpointing)
    model, dp = placed(model, mesh, fsdp, column_sharded)
    return model, cfg, dp


class DataParallelActor(Actor):
    """`rl.actor.Actor` with the model sharded by FSDP2 over `mesh` and the prompts dealt over its
    ranks (the `DataParallel` placement): same loss, mini-batches, clipping, schedule, metrics, OOM
    ladder and returned logprobs. Activation checkpointing is on where `cfg` or `fsdp` asks for it.
    `adopt(sharded_model)` runs after sharding and before the optimizer reads the shards: where the
    shards get their storage when `model` was sharded on the meta device (`shared_weights`);
    `column_sharded`: parameters sharded by columns (`apply_fsdp`)."""

    def __init__(self, model: Qwen25VL, cfg: RLConfig, mesh: DeviceMesh, fsdp: FSDPConfig | None = None,
                 memory=None, optimizer_offload: str = "none", adopt=None, column_sharded=()):
        model, cfg, self.dp = shard(model, cfg, mesh, fsdp, column_sharded)
        if adopt is not None:
            adopt(model)
        super().__init__(model, cfg, memory, optimizer_offload, placement=self.dp)


class DataParallelCritic(Critic):
    """`rl.critic.Critic` with the value model sharded by FSDP2 over `mesh` (here, or before: see
    `Colocated.place`) and the prompts dealt over its ranks (the `DataParallel` placement), as
    `DataParallelActor` for the actor: same values, loss, mini-batches, clipping, lr and OOM ladder."""

    def __init__(self, model: ValueModel, cfg: RLConfig, mesh: DeviceMesh, fsdp: FSDPConfig | None = None,
                 memory=None, optimizer_offload: str = "none"):
        model, cfg, self.dp = shard(model, cfg, mesh, fsdp)
        super().__init__(model, cfg, memory, optimizer_offload, placement=self.dp)
