"""One rank of the disaggregated RL step test: trainer and rollout ranks apart, against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from helpers import assert_fp32_close, assert_weights_close
from parallel_helpers import init_group
from parallel_step_worker import parity_reward

from rollplex.engine import EngineConfig
from rollplex.models import load_model
from rollplex.processor import VLProcessor
from rollplex.system import SystemConfig, build_disaggregated


def worker(rank: int, world: int, init: str, tiny_dir, rows, cfg, layout, want: list[dict]) -> None:
    init_group(rank, world, init)
    try:
        system = SystemConfig(device="cpu", dtype="float32", rl=cfg,
                              engine=EngineConfig(max_num_seqs=64, max_model_len=256))
        step = build_disaggregated(system, layout, model=load_model(tiny_dir),
                                   processor=VLProcessor.from_pretrained(tiny_dir), reward_fn=parity_reward)
        for w in want:
            m = step.step(rows)
            if step.role == "train":  # the same rollout, metrics and updated policy as one process
                assert torch.equal(step.last_batch.responses, w["tokens"]), "the rollouts differ"
                for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
                    assert_fp32_close(m[k], w["metrics"][k], k, scale=1.0)
                got = dict(step.model.named_parameters())
            else:  # the engine's shards hold the broadcast weights
                got = dict(step.model.named_parameters())
                w = dict(w, weights=step.tp.shard(w["weights"], step.model.cfg))
            for n, t in w["weights"].items():
                assert_weights_close(got[n].detach().float(), t, f"weight {n}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
