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

from ..engine import Engine
from ..models import Qwen25VL
from ..rl.batch import RolloutBatch
from ..rl.config import RLConfig
from ..rl.step import RLStep, rollout_requests
from .disaggregated import Disaggregated


class DisaggregatedStep:
    """This rank's part of the disaggregated RL step (see the module docstring), over the layout's groups
    `d`: a trainer rank's `rl` (RLStep without a rollout backend, data-parallel over the trainer ranks), or a
    rollout rank's `engine` (its model the engine's tensor-parallel shard over `d.tp_group`).
    rollplex.system.build_disaggregated builds both parts from one config."""

    def __init__(self, d: Disaggregated, cfg: RLConfig, processor, *, rl: RLStep | None = None,
                 engine: Engine | None = None):
        if cfg.filter_groups:  # its rollout ranks would have to follow the trainer's refills
            raise ValueError("the disaggregated step has no dynamic sampling (filter_groups): use RLStep")
        if (d.role == "train") != (rl is not None) or (rl is None) == (engine is None):
            raise ValueError(f"a {d.role} rank of the disaggregated step holds "
                             f"{'an RL step' if d.role == 'train' else 'an engine'} alone")
        self.d, self.layout, self.cfg, self.processor = d, d.layout, cfg, processor
        self.step_idx = 0
        self.rl, self.engine = rl, engine
        # a rollout rank's plan: its model is its engine's tensor-parallel shard
        self.tp = None if engine is None else engine.tp
        self.model: Qwen25VL = rl.model if rl is not None else engine.model
        self.device = self.model.inv_freq.device
        self.last_batch: RolloutBatch | None = None  # the last rollout with its rewards (trainer ranks)

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
