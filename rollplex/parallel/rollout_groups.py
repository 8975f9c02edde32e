"""Which ranks form each tensor-parallel rollout engine, chosen for weight sharing.

The colocated step trains with FSDP2 over every rank of its group (rank r holds FSDP shard r: FSDP2
shards by the rank's position in the group, whatever order a mesh lists) and rolls out with engines of
N ranks. A rank's TP rank is its position in its engine's group (torch orders a group's ranks), so the
free choice is which ranks form each engine: a rank's rollout slot g * N + t then decides which of its
training rows are already resident in its rollout shard (`rollplex.weights`). `best_rollout_groups`
takes `weights.engine_mapping`: the digit interleaving of (g, t) into the rank (consecutive blocks,
strided, and the mixes between; each keeps t increasing with the rank inside a group, as torch numbers
it) under which the runtime shares the most (`weights.realised`: windows of the engine's tensors
only), consecutive blocks on a tie. `rollout_slots` reads the slots back
from the engines' groups, whichever way they were formed.
"""

from __future__ import annotations

import torch.distributed as dist

from ..models import ModelConfig
from ..weights import engine_mapping, model_specs


def best_rollout_groups(cfg: ModelConfig, world: int, tp: int, vision: bool = False) -> list[list[int]]:
    """The ranks of each rollout engine of `tp` ranks over `world` ranks, each group in TP-rank order,
    that let the trainer's FSDP2 shards share the most of the engines' tensors (torch-free planning on
    the model's shapes: `weights.engine_mapping`)."""
    if tp < 1 or world % tp:
        raise ValueError(f"rollout TP {tp} does not divide the world size {world}")
    if tp in (1, world):  # one engine per rank, or one over all ranks: nothing to choose
        return [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]
    return groups_of(engine_mapping(model_specs(cfg), world, tp, vision_tp=vision).slot_of, tp)


def groups_of(slot_of: tuple[int, ...], tp: int) -> list[list[int]]:
    """Rollout groups (rank lists in TP-rank order) of a mapping rank -> slot g * tp + t."""
    out = [[0] * tp for _ in range(len(slot_of) // tp)]
    for r, slot in enumerate(slot_of):
        out[slot // tp][slot % tp] = r
    return out


def new_rollout_group(cfg: ModelConfig, tp: int, group: dist.ProcessGroup | None = None,
                      vision: bool = False) -> dist.ProcessGroup | None:
    """This rank's engine group of `tp` ranks over `group` (default: the default group), formed by
    `best_rollout_groups` (`vision`: the engines split the vision tower's blocks too); None when one
    engine spans the whole group (pass it as is). A collective: every rank of the default group calls
    it (torch creates every group on every rank)."""
    world = dist.get_world_size(group)
    if tp == world:
        return None
    ranks = [[dist.get_global_rank(group, r) if group is not None else r for r in g]
             for g in best_rollout_groups(cfg, world, tp, vision)]
    mine, _ = dist.new_subgroups_by_enumeration(ranks)
    return mine


def rollout_slots(tp_group: dist.ProcessGroup, tp_rank: int, tp_size: int,
                  group: dist.ProcessGroup) -> tuple[int, ...]:
    """Every rank's rollout slot g * tp_size + t over `group` (rank -> slot), from the engines' process
    groups (a collective over `group`: each rank sends its engine's members). Engines are numbered by
    their first rank. ValueError unless the engines partition `group` into groups of tp_size ranks."""
    world = dist.get_world_size(group)
    members = sorted(dist.get_group_rank(group, g) for g in dist.get_process_group_ranks(tp_group))
    every: list = [None] * world
    dist.all_gather_object(every, (members, tp_rank), group=group)
    engines = sorted({tuple(m) for m, _ in every})
    if (world % tp_size or any(len(e) != tp_size for e in engines)
            or sorted(r for e in engines for r in e) != list(range(world))
            or any(every[r][1] != e.index(r) for e in engines for r in e)):
        raise ValueError("the tensor-parallel engines must partition the data-parallel group into groups of "
                         f"{tp_size} ranks (tensor_parallel_copy over parallel.new_rollout_group, "
                         "dist.new_subgroups, or the whole group)")
    slot_of = [0] * world
    for g, e in enumerate(engines):
        for t, r in enumerate(e):
            slot_of[r] = g * tp_size + t
    return tuple(slot_of)
