"""The RL step data-parallel over a process group, colocated: every rank rolls out, scores and trains.

`data_parallel(model, engine, cfg, group)` builds one of these for `rl.step.RLStep(..., parallel=...)`: the
step's runtime (an `rl.runtime.Runtime`, each operation answered for this rank; the fused schedule's
stages in parallel/fused.py, the rollout backend in parallel/rollout.py). Per rank:

    policy      what the engine decodes (`RLStep.model`): the full weights (per-rank rollout), or this
                rank's tensor-parallel shard of them (then the whole weights are gathered from the
                trainer, `full_state`)
    trainer     the policy sharded by FSDP2 over the group (`place`), its shards windows of
                the engine's tensors where the sharing plan allows (`shared_weights`): an update writes
                those in place and `sync_weights` rebuilds only the rest
    reference   the frozen reference sharded the same way (or whole on every rank:
                `FSDPConfig(shard_reference=False)`, each rank scoring its share, `ShareScoring`)
    rollout     prompts dealt round-robin over rollout groups (a rank alone, or a tensor-parallel group of
                ranks decoding its shards together), each group's engine generating its share, the
                outputs gathered so every rank holds the whole batch

Sampling is seeded per prompt and sample, so the data-parallel step computes the single-process step
(the first epoch's mini-batches follow the engines' interleaved finishing order). The co-scheduler runs
per rank on the prompts its engine prefilled (`share`), a sharded model's prefixes as one sweep in
lockstep with the other ranks' (`Trainer.sweep_gather`). More in docs/PARALLEL.md ("The data-parallel RL step").
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine import Engine
from ..models import Qwen25VL
from ..rl.actor import Actor
from ..rl.config import RLConfig
from ..rl.placement import SingleProcess
from ..rl.rollout import NativeRollout
from ..rl.runtime import Runtime
from ..rl.trainer import Trainer
from .data_parallel import check_passes, placed
from .fsdp import FSDPConfig, apply_fsdp, full_tensor
from .fused import DataParallelFused
from .lockstep import ShardGather
from .rollout import DataParallelRollout
from .rollout_groups import rollout_slots
from .shared_weights import SharedWeights, column_sharded, meta_copy


def data_parallel(model: Qwen25VL, engine, cfg: RLConfig, group: dist.ProcessGroup | str | None = "auto",
                  fsdp: FSDPConfig | None = None) -> Colocated | None:
    """The `parallel` an RLStep over `model` and `engine` (a rollplex Engine, a rollout backend or None)
    takes: this rank's part of a data-parallel step over `group` (a group of one rank included), or None
    for the single-process step. group "auto": the default group when torch.distributed is initialised
    with more than one rank (a group of one has nothing to split: the single-process step, without
    FSDP's copies); None: this process alone. fsdp: the trainer's and reference's FSDPConfig."""
    if group == "auto":
        group = dist.group.WORLD if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
            else None
    if group is None:
        return None
    if isinstance(engine, NativeRollout):
        engine = engine.engine
    if engine is not None and not isinstance(engine, Engine):
        raise ValueError("a data-parallel RL step needs the native rollout backend, not "
                         f"{getattr(engine, 'name', type(engine).__name__)}")
    return Colocated(group, model, engine, cfg, fsdp)


def check_config(cfg: RLConfig) -> None:
    """ValueError for a config a data-parallel step cannot run."""
    if cfg.cosched and cfg.schedule == "fused":
        # each rank co-schedules the prefixes its engine prefilled, a sharded model's as one sweep in
        # lockstep with the other ranks': a chunk's worker cannot take a job over without a collective
        raise ValueError("cosched with schedule='fused' runs on one process only: a data-parallel step "
                         "co-schedules prefixes with schedule='phased', or fuses without cosched")


class ShareScoring(SingleProcess):
    """The scoring passes of a model every rank holds whole (the old policy a per-rank engine decodes, a
    reference not sharded): each rank scores its share of the prompts (`Colocated.share`: those its engine
    prefilled, whose prefix states its co-scheduler handed over), in the micro-batches one process plans with
    no collective inside them, so an out-of-memory error backs off on that rank alone; the shares are summed
    over the group."""

    def __init__(self, rank: Colocated):
        self.rank, self.world = rank, rank.world

    def share(self, batch, mode: str) -> tuple:
        return batch.select_prompts(self.rank.share(batch.num_prompts))

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.rank.group)
        return t


class Colocated(Runtime):
    """This rank's part of the data-parallel RL step (see the module docstring): the runtime `RLStep` runs
    over (rl/runtime.py), each operation answered for this rank of the group."""

    def __init__(self, group: dist.ProcessGroup, model: Qwen25VL, engine, cfg: RLConfig,
                 fsdp: FSDPConfig | None = None):
        check_passes(cfg.mode, cfg.packed)
        self.group, self.model_cfg = group, model.cfg
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        device = model.inv_freq.device
        self.mesh = DeviceMesh.from_group(group, device.type)
        self.fsdp = fsdp or FSDPConfig()
        self.rollout, self.tp_size, self.tp_rank = "data", 1, 0
        # every rank's rollout slot g * tp_size + t (rank -> slot): which shard of which engine it holds
        self.slot_of = tuple(range(self.world))
        # the plan of a tensor-parallel engine's model (its shard of the policy), None for the policy whole
        self.tp = None
        if engine is not None and engine.model is not model:
            tp = self.tp = engine.tp
            if tp is None:
                raise ValueError("under data parallelism the engine decodes the policy itself (per-rank rollout) "
                                 "or its tensor-parallel shard (tensor_parallel_copy) over the whole group or "
                                 "over groups of ranks that partition it (parallel.new_rollout_group)")
            self.rollout, self.tp_size, self.tp_rank = "tensor", tp.size, tp.rank
            self.slot_of = rollout_slots(tp.group, tp.rank, tp.size, group)
        # rollout groups: one engine each (a rank alone, or a tensor-parallel group of tp_size ranks)
        self.groups, self.rollout_group = self.world // self.tp_size, self.slot_of[self.rank] // self.tp_size
        self.engine = engine
        # what the engine decodes, and RLStep.model: the policy itself or this rank's tensor-parallel copy
        self.policy = engine.model if self.rollout == "tensor" else model
        self.weights: SharedWeights | None = None  # set when the trainer is placed
        self.trainer_placement = None  # the trainer's DataParallel placement, set with it
        self._sweep_group: dist.ProcessGroup | None = None  # the co-scheduled gathers' own group
        self.fused = DataParallelFused(self)  # where the fused schedule's stages run (parallel/fused.py)

    # ---- the step's rollout, config and footprint ----------------------------------------------------------
    def bind(self, backend, model: Qwen25VL, memory, cfg: RLConfig):
        """The backend this rank rolls out on (`DataParallelRollout` over the engine this group was built over,
        or None without one): the step's must be that engine, under the step's memory. ValueError for a config
        a data-parallel step cannot run."""
        engine = backend.engine if isinstance(backend, NativeRollout) else None
        if backend is not None and engine is None:
            raise ValueError(f"a data-parallel RL step needs the native rollout backend, not {backend.name}")
        if self.engine is not engine:
            raise ValueError("the data-parallel placement was built over another engine than the step's")
        check_config(cfg)
        if engine is None:
            return None
        out = DataParallelRollout(self)
        out.attach(model, memory)
        return out

    def trainer_footprint(self, trainable: int, param_bytes: int, decoder, vision) -> tuple[int, int, bool, bool]:
        """(this rank's share of the trainable elements, the bytes its shards add to the engine's weights where
        they are not windows of them, checkpointing with FSDP's own flags as choices given)."""
        n = -(-trainable // self.world)
        weights = 0 if self.fsdp.share_policy_storage else n * param_bytes
        return (n, weights, True if self.fsdp.activation_checkpointing else decoder,
                True if self.fsdp.vision_activation_checkpointing else vision)

    # ---- scoring ------------------------------------------------------------------------------------
    def old_scorer(self, actor: Actor, cfg: RLConfig) -> Trainer:
        """The trainer whose scores are the old logprobs: with several updates and a per-rank engine, one over
        the policy that engine decodes, each rank scoring its share (`ShareScoring`); else the actor's own."""
        if cfg.num_updates > 1 and self.holds_policy:
            return Trainer(self.policy, placement=ShareScoring(self), role="old-logprob",
                           score_backoff=actor.score_backoff)
        return actor

    # ---- the whole policy, every rank's objects ------------------------------------------------------
    def policy_state(self, policy: Qwen25VL, trainer: Qwen25VL, keep: bool) -> dict | None:
        if self.holds_policy:
            return {n: p.detach() for n, p in policy.named_parameters()} if keep else None
        return self.full_state(trainer, keep)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable, on the host), in rank order."""
        every: list = [None] * self.world
        dist.all_gather_object(every, obj, group=self.group)
        return every

    # ---- models -------------------------------------------------------------------------------
    def place(self, build, region, trainable: bool, role: str) -> Trainer:
        """`build()` (whole on every rank) sharded like the trainer over the group, only its shards in the region
        `region()` enters, as a Trainer over them and the `DataParallel` placement of their passes:
        - the policy (trained, a `Qwen25VL`): its structure sharded on the meta device, the shards then adopted
          into the engine's tensors where the plan shares them and cut from the whole weights otherwise
          (`SharedWeights`): no transient copy of the whole weights is allocated;
        - PPO's value model (trained): sharded like the policy;
        - the frozen reference: sharded without checkpointing (it only scores; the step scores it where the
          actor's passes run), or whole on every rank in the region with `FSDPConfig(shard_reference=False)`,
          each rank then scoring its share (`ShareScoring`)."""
        if not trainable and not self.fsdp.shard_reference:
            with region():
                return Trainer(build(), placement=ShareScoring(self), role=role)
        model = build()  # a transient whole copy: only its shards go into the region
        if not trainable:
            cfg = dataclasses.replace(self.fsdp, activation_checkpointing=False, vision_activation_checkpointing=False)
            with region():
                ref = apply_fsdp(model, self.mesh, cfg)
            return Trainer(ref, role=role, sweeps=self._sweeps(ref))
        if not isinstance(model, Qwen25VL):  # PPO's value model
            with region():
                sharded, dp = placed(model, self.mesh, self.fsdp)
            return Trainer(sharded, placement=dp, role=role, sweeps=self._sweeps(sharded))
        columns = column_sharded(model, self.world, self.tp_size)
        with region():
            sharded, dp = placed(meta_copy(model), self.mesh, self.fsdp, columns)
            self.weights = SharedWeights(sharded, self.policy, model, self.group,
                                         share=self.fsdp.share_policy_storage, slot_of=self.slot_of, tp=self.tp)
        self.trainer_placement = dp
        return Trainer(sharded, placement=dp, role=role, sweeps=self._sweeps(sharded))

    def _sweeps(self, model: nn.Module):
        """What makes the gather a co-scheduled sweep of `model` (sharded over this group: the trainer, a sharded
        reference) runs its units on: a `ShardGather` (parallel/lockstep.py) on a process group of this group's
        ranks that nothing else uses, made on first use (every rank plans its sweeps in the same rollout)."""
        def make():
            if self._sweep_group is None:
                self._sweep_group = dist.new_group(dist.get_process_group_ranks(self.group),
                                                   use_local_synchronization=True)
                assert dist.get_rank(self._sweep_group) == self.rank, "the sweep group orders the ranks like the mesh"
            return ShardGather(model, self._sweep_group).gather
        return make

    # ---- rollout ------------------------------------------------------------------------------
    def group_prompts(self, num_prompts: int) -> list[int]:
        """The prompts (indices) this rank's rollout group generates: dealt round-robin over the groups."""
        return list(range(self.rollout_group, num_prompts, self.groups))

    def share(self, num_prompts: int) -> list[int]:
        """This rank's part of its rollout group's prompts (all of them with a per-rank engine): the
        prompts a model it holds whole scores here (`ShareScoring`) and whose prefixes its
        co-scheduler computes beside its decode — prompts its own engine prefilled."""
        return self.group_prompts(num_prompts)[self.tp_rank :: self.tp_size]

    def generate(self, prompts: list, params: list, keep_vision: bool = False, on_output=None) -> list:
        """The engine's outputs for every prompt, on every rank (see the module docstring). on_output(i,
        output): called as each prompt i of this rank's engine finishes (the engine's `on_output`)."""
        if self.groups == 1:  # one engine: every rank generated every prompt
            return self.engine.generate(prompts, params, keep_vision=keep_vision, on_output=on_output)
        share = self.group_prompts(len(prompts))
        report = None if on_output is None else (lambda i, out: on_output(share[i], out))
        outs = self.engine.generate([prompts[i] for i in share], [params[i] for i in share],
                                    keep_vision=keep_vision, on_output=report) if share else []
        # the ranks of a tensor-parallel group hold the same outputs: its first rank contributes them. The
        # groups' finishing orders interleave: each group's k-th group finished before any group's (k+1)-th
        mine = ([(i, dataclasses.replace(o, vision_embeds=None, meta=self._finished(o.meta)))
                 for i, o in zip(share, outs)] if self.tp_rank == 0 else [])
        every: list = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        got = dict(x for part in every for x in part)
        return [got[i] for i in range(len(prompts))]

    def _finished(self, meta: dict) -> dict:
        """`meta` with its engine's finish_index made the whole rollout's: (k-th of its group) x groups + group."""
        if meta.get("finish_index") is None:
            return dict(meta)
        return {**meta, "finish_index": meta["finish_index"] * self.groups + self.rollout_group}

    # ---- weights ------------------------------------------------------------------------------
    @property
    def holds_policy(self) -> bool:
        """Whether this rank holds the policy whole (a per-rank engine decodes it)."""
        return self.rollout == "data"

    @torch.no_grad()
    def sync_weights(self, m: dict | None = None, timed=contextlib.nullcontext) -> None:
        """After an update: the engine's elements that are not windows of this rank's trainer shards, rebuilt
        from the shards that hold them (timed by `timed()`); the engine's tensors and CUDA graphs stay valid.
        Into `m`: the weights' and the trainer placement's metrics."""
        with timed():
            self.weights.rebuild()
        if m is not None:
            m.update(self.weight_metrics())
            m.update(self.trainer_placement.take_metrics())

    def full_state(self, trainer: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """{name: whole parameter} of the policy, gathered from the trainer's shards (a collective:
        every rank calls it; only where `keep`, each tensor on the host)."""
        out = {}
        for name, p in trainer.named_parameters():
            whole = full_tensor(p.detach())
            if keep:
                out[name] = self.weights.natural(name, whole).cpu()
            del whole
        return out if keep else None

    def weight_metrics(self) -> dict[str, float]:
        """This rank's trainer shards shared with the engine's tensors, kept apart, and rebuilt after each
        update."""
        r = self.weights.report()
        return {"perf/weights_shared_gib": r["shared_bytes"] / 2**30,
                "perf/weights_separate_gib": r["separate_bytes"] / 2**30,
                "perf/weights_rebuilt_gib": r["rebuilt_bytes"] / 2**30}
