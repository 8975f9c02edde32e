"""One rank of the runtime weight-sharing test: the trainer sharded on the meta device, its FSDP2 shards
adopted into the engine's tensors (the policy itself, or its tensor-parallel copy), one update, then what
the engine's weights hold before and after the rebuild."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_helpers import init_group, rollout_batch, tiny_cfg, tiny_model
from torch.distributed.device_mesh import init_device_mesh

from rollplex.parallel import DataParallelActor, full_tensor
from rollplex.parallel.shared_weights import SharedWeights, meta_copy
from rollplex.rl.config import RLConfig
from rollplex.rl.step_memory import separate_bytes


def worker(rank: int, world: int, init: str, tie: bool, want: dict) -> None:
    init_group(rank, world, init)
    try:
        policy = tiny_model(tiny_cfg(tie))
        policy.visual.requires_grad_(False)  # a frozen tower: adopted, never rebuilt
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        held: list[SharedWeights] = []
        actor = DataParallelActor(meta_copy(policy), RLConfig(lr=1e-2, micro_batch_prompts=1),
                                  init_device_mesh("cpu", (world,)),
                                  adopt=lambda m: held.append(SharedWeights(m, policy, policy, dist.group.WORLD)))
        shared = held[0]
        trainer = dict(actor.model.named_parameters())
        report = shared.report()
        assert shared.shared == want["shared"][rank], sorted(shared.shared ^ want["shared"][rank])[:4]
        assert report["separate_bytes"] == want["separate"][rank], report
        # the memory plan counts the same bytes from the storages alone
        assert separate_bytes(policy, actor.model) == report["separate_bytes"]
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


def tp_worker(rank: int, world: int, init: str, tp_size: int, tie: bool, best: bool = False) -> None:
    """The engine decodes a tensor-parallel copy over groups of `tp_size` ranks (consecutive blocks, or
    `best`: the groups chosen for sharing) and nothing holds the policy whole after the build: shared
    shards alias the engine's storage (an update is visible to the engine before any rebuild), the rest
    is rebuilt equal to the gathered truth's TP shards."""
    from rollplex.parallel import new_rollout_group, shard_state_dict, tensor_parallel_copy
    from rollplex.parallel.fsdp import layer_ops, local_tensor
    from rollplex.parallel.rollout_groups import rollout_slots
    from rollplex.parallel.shared_weights import column_sharded

    init_group(rank, world, init)
    try:
        policy = tiny_model(tiny_cfg(tie))
        cfg = policy.cfg
        group = (new_rollout_group(cfg, tp_size) if best else
                 None if tp_size == world else dist.new_subgroups(tp_size)[0])
        engine, tp = tensor_parallel_copy(policy, group)
        slot_of = rollout_slots(tp.group, tp.rank, tp.size, dist.group.WORLD)
        if best:  # tiny shapes at TP 2 over 4 ranks: strided engines share more than consecutive ones
            assert slot_of == (0, 2, 1, 3), slot_of
        held: list[SharedWeights] = []
        actor = DataParallelActor(meta_copy(policy), RLConfig(lr=1e-2, micro_batch_prompts=1),
                                  init_device_mesh("cpu", (world,)),
                                  adopt=lambda m, whole=policy: held.append(SharedWeights(m, engine, whole,
                                                                                          dist.group.WORLD,
                                                                                          slot_of=slot_of, tp=tp)),
                                  column_sharded=column_sharded(policy, world, tp_size))
        del policy  # the engine's copy and the trainer's shards are all that is left
        shared = held[0]
        trainer = dict(actor.model.named_parameters())
        params = dict(engine.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        # what the engine keeps whole (vision tower, norms) and the vocab shards (rows V/tp, lined up with
        # FSDP's V/world at these sizes) are shared; a fused q/k/v or a row-parallel shard is not one window
        assert {"visual.blocks.0.attn.qkv.weight", "model.norm.weight"} <= shared.shared
        vocab, t = cfg.text.vocab_size, tp.rank  # this rank's FSDP rows inside its vocab shard's rows
        lo, hi = rank * vocab // world, (rank + 1) * vocab // world
        inside = t * vocab // tp_size <= lo < hi <= (t + 1) * vocab // tp_size
        assert ("model.embed_tokens.weight" in shared.shared) == inside
        # with one engine over every rank the trainer shards o / down by columns and stores q/k/v and gate/up
        # in blocked order (rows grouped by TP shard): each is the rank's engine shard, shared (q/k/v where no
        # KV head is replicated over ranks: a replicated head is stored once). Under several engines FSDP
        # chunks the rows as they are: a row-parallel shard (a column window) is never one chunk, a fused
        # [q_t; k_t; v_t] only where the chunk is q_t alone (at TP 2 over 4 consecutive ranks, ranks 0
        # and 1; strided engines: rank 0 only, rank 1 holding q_1 as TP rank 0)
        one = tp_size == world
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight"):
            assert (name in shared.shared) == one, (name, sorted(shared.shared))
        assert not one or "model.layers.0.mlp.gate_up_proj.weight" in shared.shared
        assert trainer["model.layers.0.mlp.down_proj.weight"].placements[0].dim == (1 if one else 0)
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        if one and tp_size <= cfg.text.num_key_value_heads:
            assert qkv in shared.shared and (qkv in shared.rows) and layer_ops(actor.model) is not None
        elif not one:
            assert (qkv in shared.shared) == (rank < (1 if best else 2)), sorted(shared.shared)
            assert not shared.rows and layer_ops(actor.model) is None
        for name in shared.shared:  # same storage, at the plan's offset
            assert local_tensor(trainer[name]).untyped_storage().data_ptr() == params[name].untyped_storage().data_ptr()
        report = shared.report()
        assert separate_bytes(engine, actor.model) == report["separate_bytes"]
        # one engine: every trainer shard lies in an engine tensor (nothing separate); what the engine
        # replicates (the vision tower, norms, a KV head over two ranks) still takes other ranks' rows
        whole = one and tp_size <= cfg.text.num_key_value_heads
        assert report["rebuilt_bytes"] > 0, report
        if whole:
            assert report["separate_bytes"] == 0 and shared.shared == set(params), report
        elif not one:
            assert report["separate_bytes"] > 0, report

        batch, adv, ref = rollout_batch()
        actor.update(batch, adv, ref, None)
        new = {n: shared.natural(n, full_tensor(p.detach())) for n, p in trainer.items()}
        want = shard_state_dict(new, cfg, tp.size, tp.rank)
        for name in shared.shared:  # the update is in the engine's tensor already, no copy has run
            plan = shared.plan.param(name, rank)
            got = params[name].detach().reshape(plan.rollout.rows, -1)
            lo = plan.share.train_offset // plan.train.width
            rows = plan.train.rows
            assert torch.equal(got[lo : lo + rows], local_tensor(trainer[name]).reshape(rows, -1)), name
        moved = [n for n in params if n not in shared.shared and not torch.equal(want[n], before[n])]
        assert set(moved) == set(params) - shared.shared  # every unshared engine tensor: not before the rebuild
        assert all(torch.equal(params[n], before[n]) for n in moved)
        shared.rebuild()
        for name, p in params.items():  # the engine's shards of the gathered truth, bit for bit
            assert torch.equal(p, want[name]), name
        dist.barrier()
    finally:
        dist.destroy_process_group()
