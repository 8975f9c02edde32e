"""The RL step in the disaggregated layout: rollout on some ranks, training on the others.

The baseline Rollplex's colocated step is measured against (disaggregated.py has the layout). Every
rank of the layout calls `DisaggregatedStep.step(rows)` with the same rows:

    rollout ranks   each engine (a tensor-parallel group of `rollout_tp` ranks, its model in the wire
                    dtype) generates its share of the prompts, dealt round-robin over the engines, with
                    the seeds `RLStep.rollout` would use (rl.step.rollout_requests), so the samples are
                    the ones one process draws
    all ranks       the outputs are gathered to every rank (each engine's first rank contributes them)
    trainer ranks   rewards, reference scoring and the update: `RLStep.train` data-parallel over the
                    trainer ranks (FSDP2 trainer and reference; the policy whole on each, the trainer's
                    shards inside it); the rollout ranks wait, the GPU time this layout loses
    all ranks       the trainer's updated policy is broadcast from trainer rank 0 to every rollout rank
                    in buckets of the wire dtype; each rollout rank copies its shards in place

Metrics are the trainer's (every trainer rank returns the same); rollout ranks return their timings.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ..engine import Engine, EngineConfig
from ..models import Qwen25VL
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep, rollout_requests
from .colocated import data_parallel
from .disaggregated import DisaggregatedLayout, init_disaggregated
from .fsdp import DTYPES, FSDPConfig
from .tp import apply_tensor_parallel


class DisaggregatedStep:
    """This rank's part of the disaggregated RL step (see the module docstring). `model`: the initial
    policy, the same full weights on every rank; a rollout rank keeps only its tensor-parallel shard."""

    def __init__(self, layout: DisaggregatedLayout, model: Qwen25VL, processor, cfg: RLConfig, reward_fn,
                 engine_cfg: EngineConfig | None = None, fsdp: FSDPConfig | None = None):
        if cfg.filter_groups:  # its rollout ranks would have to follow the trainer's refills
            raise ValueError("the disaggregated step has no dynamic sampling (filter_groups): use RLStep")
        device = model.inv_freq.device
        self.d = init_disaggregated(layout, device.type)
        self.layout, self.cfg, self.processor, self.device = layout, cfg, processor, device
        self.step_idx = 0
        self.rl = self.engine = None
        self.tp = None  # a rollout rank's plan: its model is its engine's tensor-parallel shard
        self.last_batch: RolloutBatch | None = None  # the last rollout with its rewards (trainer ranks)
        if self.d.role == "train":
            self.model = model
            self.rl = RLStep(model, None, cfg, processor, reward_fn=reward_fn,
                             parallel=data_parallel(model, None, cfg, self.d.train_mesh.get_group(), fsdp))
        else:
            self.model = model.to(DTYPES[layout.wire_dtype])
            self.tp = apply_tensor_parallel(self.model, self.d.tp_group)
            self.engine = Engine(self.model, processor, engine_cfg, tp=self.tp)

    @property
    def role(self) -> str:
        return self.d.role

    def _timed(self, m: dict, key: str, fn):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        out = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        m[f"timing_s/{key}"] = time.perf_counter() - t0
        return out

    def step(self, rows: list[dict]) -> dict:
        """The step on dataset rows (every rank the same rows); the trainer's verl-named metrics."""
        prompts, params, per_prompt = rollout_requests(self.processor, rows, self.cfg, self.step_idx)
        return self.run(prompts, params, per_prompt)

    def run(self, prompts: list, params: list, per_prompt: dict | None = None,
            rewards: torch.Tensor | None = None) -> dict:
        """The step on prompts (ModelInputs) and their SamplingParams; `rewards` [N]: given rewards
        instead of the reward function's (per_prompt then needs no ground truths)."""
        m: dict = {}
        t0 = time.perf_counter()
        outs = self._timed(m, "gen", lambda: self._generate(prompts, params))
        if self.rl is not None:
            batch = RolloutBatch.from_outputs(prompts, outs, pad_id=self.model.cfg.pad_token_id or 0,
                                              **(per_prompt or {}))
            if rewards is None:
                batch.rewards, extra = self._timed(m, "reward", lambda: self.rl.compute_rewards(batch))
                m.update(extra)
            else:
                batch.rewards = rewards
            self.last_batch = batch
            m.update(self.rl.train(batch))
        self._timed(m, "broadcast_weights", lambda: self.d.sync_weights(self.model, self.tp))
        self.step_idx += 1
        m["timing_s/step"] = time.perf_counter() - t0
        m["training/global_step"] = self.step_idx
        return m

    def _generate(self, prompts: list, params: list) -> list:
        """Every prompt's RequestOutput on every rank: each engine generates its share."""
        mine = []
        if self.engine is not None:
            share = list(range(self.d.replica, len(prompts), self.layout.replicas))
            outs = self.engine.generate([prompts[i] for i in share], [params[i] for i in share]) if share else []
            if self.d.rank == self.layout.replica_ranks(self.d.replica)[0]:
                mine = [(i, dataclasses.replace(o, vision_embeds=None)) for i, o in zip(share, outs)]
        every: list = [None] * self.layout.world
        dist.all_gather_object(every, mine)
        got = dict(x for part in every for x in part)
        return [got[i] for i in range(len(prompts))]
