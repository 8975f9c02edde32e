"""One rank of the runtime weight-sharing test: the trainer sharded on the meta device, its FSDP2 shards
adopted into the policy's tensors, one update, then what the policy (the engine's weights) holds before
and after the rebuild."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model
from torch.distributed.device_mesh import init_device_mesh

from rollplex.parallel import DataParallelActor, full_tensor
from rollplex.parallel.shared_weights import SharedWeights, meta_copy
from rollplex.rl.config import RLConfig


def worker(rank: int, world: int, init: str, tie: bool, want: dict) -> None:
    init_group(rank, world, init)
    try:
        policy = tiny_model(tiny_cfg(tie))
        policy.visual.requires_grad_(False)  # a frozen tower: adopted, never rebuilt
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        held: list[SharedWeights] = []
        actor = DataParallelActor(meta_copy(policy), RLConfig(lr=1e-2, micro_batch_prompts=1),
                                  init_device_mesh("cpu", (world,)),
                                  adopt=lambda m: held.append(SharedWeights(m, policy, dist.group.WORLD)))
        shared = held[0]
        trainer = dict(actor.model.named_parameters())
        report = shared.report()
        assert shared.shared == want["shared"][rank], sorted(shared.shared ^ want["shared"][rank])[:4]
        assert report["separate_bytes"] == want["separate"][rank], report
        # a shared shard is a window of the policy's tensor: same storage, its rows
        for name in shared.shared:
            local, full = trainer[name].to_local(), policy.get_parameter(name)
            chunk = -(-full.shape[0] // world)
            assert local.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(), name
            assert local.data_ptr() == full[rank * chunk :].data_ptr(), name
        assert all(torch.equal(full_tensor(p.detach()), before[n]) for n, p in trainer.items())

        batch, adv, ref = rollout_batch()
        actor.update(batch, adv, ref, None)
        new = {n: full_tensor(p.detach()) for n, p in trainer.items()}
        moved = 0
        for name, p in policy.named_parameters():
            chunk = (p.shape[0] + world - 1) // world
            lo, hi = min(rank * chunk, p.shape[0]), min((rank + 1) * chunk, p.shape[0])
            if name in shared.shared:  # this rank's rows are the update itself: no copy has run
                assert torch.equal(p[lo:hi], new[name][lo:hi]), name
            else:  # nothing reaches a separate shard's rows before the rebuild
                assert torch.equal(p[lo:hi], before[name][lo:hi]), name
            rest = torch.ones(p.shape[0], dtype=torch.bool)
            rest[lo:hi] = False
            assert torch.equal(p[rest], before[name][rest]), name  # other ranks' rows wait for the rebuild
            moved += int(not torch.equal(new[name], before[name]))
        assert moved > 0
        shared.rebuild()
        for name, p in policy.named_parameters():  # the rebuilt policy is the gathered truth, bit for bit
            assert torch.equal(p, new[name]), name
            if name.startswith("visual."):
                assert torch.equal(p, before[name]), name
        dist.barrier()
    finally:
        dist.destroy_process_group()
