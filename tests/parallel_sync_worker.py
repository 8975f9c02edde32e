"""One rank of the disaggregated weight-sync test: trainer ranks update the actor (FSDP2) and send its
weights; rollout ranks (tensor-parallel engines) receive them. The trainer's gathered weights then go
to every rank by a plain object broadcast, and each rollout rank's live parameters must equal its
shard of them, in the wire dtype, bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model

from rollplex.engine import Engine, EngineConfig, SamplingParams
from rollplex.parallel import (
    DataParallelActor,
    DisaggregatedLayout,
    apply_tensor_parallel,
    full_state_dict,
    init_disaggregated,
    shard_state_dict,
)
from rollplex.parallel.fsdp import DTYPES
from rollplex.rl.config import RLConfig


def worker(rank: int, world: int, init: str, layout: DisaggregatedLayout) -> None:
    init_group(rank, world, init)
    try:
        d = init_disaggregated(layout)
        cfg = tiny_cfg()
        model = tiny_model(cfg)
        wire = DTYPES[layout.wire_dtype]
        initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        if d.role == "train":
            actor = DataParallelActor(model, RLConfig(lr=1e-2, kl_coef=0.05), d.train_mesh)
            batch, adv, ref = rollout_batch()
            actor.update(batch, adv, ref)
            d.sync_weights(model)
            full = full_state_dict(model)  # a collective over the trainer ranks
            truth = [full if rank == d.src else None]
        else:
            tp = apply_tensor_parallel(model, d.tp_group)
            assert tp.size == layout.rollout_tp and d.replica == (rank - layout.train) // layout.rollout_tp
            model.to(wire)
            engine = Engine(model, None, EngineConfig(kv_cache_tokens=256, max_model_len=64), tp=tp)
            params = dict(model.named_parameters())
            ptrs = {n: p.data_ptr() for n, p in params.items()}
            d.sync_weights(model, tp)
            assert all(p.data_ptr() == ptrs[n] for n, p in params.items())  # in place: the engine sees them
            truth = [None]
        dist.broadcast_object_list(truth, src=d.src)
        if d.role == "rollout":
            want = shard_state_dict({n: t.to(wire) for n, t in truth[0].items()}, cfg, tp.size, tp.rank)
            for n, p in params.items():
                assert p.dtype == wire and torch.equal(p, want[n]), n
            changed = shard_state_dict({n: t.to(wire) for n, t in initial.items()}, cfg, tp.size, tp.rank)
            assert sum(not torch.equal(p, changed[n]) for n, p in params.items()) > len(params) // 2
            out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
            assert len(out[0].samples[0].token_ids) == 3
        dist.barrier()
    finally:
        dist.destroy_process_group()
