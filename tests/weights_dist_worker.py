"""One rank of the gloo rebuild test. Imports neither rollplex.models nor transformers, so a spawned
rank starts in about the time torch takes to import; the ParamSpecs come pickled from the parent."""

import torch
import torch.distributed as dist

from rollplex.weights import RolloutLayout, TrainLayout, plan
from rollplex.weights.storage import allocate, cut, rebuild


def worker(rank: int, world: int, init: str, specs, train: TrainLayout, roll: RolloutLayout) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        g = torch.Generator().manual_seed(0)  # the same full weights on every rank
        full = {s.name: torch.randn(s.shape, generator=g) for s in specs}
        new = {n: f * 0.5 + 1.0 for n, f in full.items()}
        p = plan(specs, train, roll)
        mine = {s.name: allocate(p.param(s.name, rank), torch.float32) for s in specs}
        tr = {n: x.train for n, x in mine.items()}
        ro = {n: x.rollout for n, x in mine.items()}
        for s in specs:
            tr[s.name].copy_(cut(full[s.name], p.param(s.name, rank).train))
        rebuild(p, rank, tr, ro)
        for s in specs:
            assert torch.equal(ro[s.name], cut(full[s.name], p.param(s.name, rank).rollout)), s.name
        for s in specs:  # an optimizer step on every rank's shard, in place
            tr[s.name][: p.param(s.name, rank).train.rows].mul_(0.5).add_(1.0)
        stale = 0
        for s in specs:
            q, want = p.param(s.name, rank), cut(new[s.name], p.param(s.name, rank).rollout)
            if q.share is not None:  # visible to the engine with no rebuild
                w = slice(q.share.first, q.share.first + q.share.numel)
                assert torch.equal(ro[s.name].view(-1)[w], want.view(-1)[w]), s.name
            stale += not torch.equal(ro[s.name], want)
        assert stale > 0
        rebuild(p, rank, tr, ro)
        for s in specs:
            assert torch.equal(ro[s.name], cut(new[s.name], p.param(s.name, rank).rollout)), s.name
        dist.barrier()
    finally:
        dist.destroy_process_group()
