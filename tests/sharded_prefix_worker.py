"""One rank of the lockstep sweep test: a reference sharded by FSDP2 over gloo, this rank's prefix jobs
run unit by unit on gathers of their own group, against the whole model's `prefix` on one process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model
from torch.distributed.device_mesh import init_device_mesh

from rollplex.cosched import PrefixRows
from rollplex.parallel import FSDPConfig, apply_fsdp
from rollplex.parallel.lockstep import ShardGather


def _same_state(got, want) -> None:
    assert torch.equal(got.lens, want.lens) and torch.equal(got.rope_delta, want.rope_delta)
    assert torch.equal(got.last_hidden, want.last_hidden)
    for a, b in zip([*got.keys, *got.values], [*want.keys, *want.values], strict=True):
        assert torch.equal(a, b)


def worker(rank: int, world: int, init: str, shares: list[list[list[int]]], layers_per_unit: int) -> None:
    init_group(rank, world, init)
    try:
        model = tiny_model(tiny_cfg())
        whole = copy.deepcopy(model)
        sharded = apply_fsdp(model, init_device_mesh("cpu", (world,)), FSDPConfig(layers_per_unit=layers_per_unit))
        sharded.requires_grad_(False)
        prompts = rollout_batch(prompts=5)[0].prompts  # prompts 0 and 3: an image, 2: a video, 1 and 4: text
        group = dist.new_group(list(range(world)), use_local_synchronization=True)
        for case, share in enumerate(shares):
            mine = share[rank]
            rows = PrefixRows.plan(sharded, prompts, per_job=2, key=f"ref{case}", only=mine,
                                   gather=ShardGather(sharded, group).gather)
            sweep = rows.sweep
            assert rows.jobs == [sweep] and rows.planned() == mine
            # every rank's sweep has the vision tower's units (some rank's prompt needs it) whatever its own
            assert sweep.units == len(model.visual.blocks) + 1 + model.cfg.text.num_hidden_layers
            if rank == 0:
                # the other rank has issued nothing yet: the gathers are in flight and nothing ran, but the
                # call returned (a decode loop never waits on a slower rank)
                sweep.run(0, 3)
                assert sweep.issued == 3 and sweep.computed == 0
                dist.send(torch.ones(1), dst=1)  # now the other rank may start
                sweep.run(3, 4)
            else:
                dist.recv(torch.zeros(1), src=0)
                for a in range(0, sweep.units - 1, 2):  # its own chunking, short of the end
                    sweep.run(a, min(a + 2, sweep.units - 1))
            sweep.complete()
            assert sweep.done and sweep.computed == sweep.units
            with torch.no_grad():
                for job in sweep.jobs:
                    _same_state(job.state, whole.prefix([prompts[i] for i in mine if rows.rows[i][0] is job]))
        # the shards are back in the modules, untouched
        for (n, p), q in zip(sharded.named_parameters(), whole.parameters(), strict=True):
            assert torch.equal(p.full_tensor(), q), n
    finally:
        dist.destroy_process_group()
