"""The whole-model plan: a rank mapping, then share-or-rebuild for every parameter on every rank.

Decoder layers repeat, so parameters with equal `ParamSpec.signature()` have equal plans; each
signature is planned once per rank and weighted by its count (the 32B model's 1,000-odd parameters
are ~30 signatures).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .layout import ParamSpec, RolloutLayout, TrainLayout, runtime_train_layout
from .mapping import Mapping, MappingChoice, choose_mapping, interleavings
from .regions import Region, intersect_numel
from .share import ParamPlan, find_share, plan_param


@dataclass
class ModelPlan:
    specs: tuple[ParamSpec, ...]
    train: TrainLayout
    rollout: RolloutLayout
    choice: MappingChoice
    nodes: tuple[int, ...]  # node of each training rank (the chosen placement)
    share: bool
    signatures: dict[str, tuple] = field(repr=False)
    counts: dict[tuple, int] = field(repr=False)
    plans: dict[tuple, tuple[ParamPlan, ...]] = field(repr=False)  # signature -> plan of each rank

    @property
    def world(self) -> int:
        return self.train.world

    @property
    def mapping(self) -> Mapping:
        return self.choice.mapping

    def param(self, name: str, rank: int) -> ParamPlan:
        return self.plans[self.signatures[name]][rank]

    def tp_rank(self, rank: int) -> int:
        return self.mapping.slot_of[rank] % self.rollout.tp

    def rollout_groups(self) -> list[list[int]]:
        """Training ranks of each rollout group, in TP-rank order: the engine's process groups."""
        tp = self.rollout.tp
        out = [[0] * tp for _ in range(self.world // tp)]
        for r, slot in enumerate(self.mapping.slot_of):
            out[slot // tp][slot % tp] = r
        return out


def _sources(rank: int, nodes: Sequence[int], regions: Sequence[Region]) -> list[tuple[int, Region]]:
    order = sorted(range(len(nodes)), key=lambda q: (q != rank, nodes[q] != nodes[rank], abs(q - rank), q))
    return [(q, regions[q]) for q in order]


def plan(specs: Sequence[ParamSpec], train: TrainLayout, rollout: RolloutLayout, gpus_per_node: int = 8,
         share: bool = True, mapping: Mapping | None = None) -> ModelPlan:
    """share=False: training shards are not kept in the rollout dtype (e.g. FSDP2 fp32 shards with a
    bf16 MixedPrecisionPolicy), so nothing is shared. mapping: force one instead of searching."""
    world = train.world
    if world % rollout.tp:
        raise ValueError(f"rollout TP {rollout.tp} does not divide the training world size {world}")
    if gpus_per_node < 1:
        raise ValueError("gpus_per_node must be >= 1")
    signatures = {s.name: s.signature() for s in specs}
    counts: dict[tuple, int] = {}
    first: dict[tuple, ParamSpec] = {}
    for s in specs:
        counts[s.signature()] = counts.get(s.signature(), 0) + 1
        first.setdefault(s.signature(), s)
    train_regions, roll_regions = {}, {}
    for sig, sp in first.items():
        try:
            train_regions[sig] = [train.region(sp, r) for r in range(world)]
            roll_regions[sig] = [rollout.region(sp, t) for t in range(rollout.tp)]
        except ValueError as e:
            raise ValueError(f"{sp.name}: {e}") from e
    big = sum(counts[sig] * roll_regions[sig][0].numel for sig in first) * rollout.tp + 1

    def gain(r: int, t: int) -> int:
        total = 0
        for sig, n in counts.items():
            s, tr = roll_regions[sig][t], train_regions[sig][r]
            sh = find_share(s, tr) if share else None
            shared = 0 if sh is None else sh.numel
            total += n * (shared * big + intersect_numel(s, tr) - shared)
        return total

    choice = choose_mapping(world, train.tp, rollout.tp, gain, gpus_per_node, mapping)
    m = choice.mapping
    nodes = m.node_of or tuple(slot // gpus_per_node for slot in m.slot_of)
    plans = {}
    for sig in first:
        per_rank = []
        for r in range(world):
            s = roll_regions[sig][m.slot_of[r] % rollout.tp]
            per_rank.append(plan_param(s, train_regions[sig][r], _sources(r, nodes, train_regions[sig]), share))
        plans[sig] = tuple(per_rank)
    return ModelPlan(tuple(specs), train, rollout, choice, nodes, share, signatures, counts, plans)


def in_place(p: ParamPlan) -> bool:
    """Whether a share lives in the rollout tensor as an engine allocates it: the (unpadded) training
    shard is a window of the rollout tensor, and the buffer is nothing more. A runtime whose engine
    holds its tensors before the trainer exists (CUDA graphs keep their addresses) realises only these."""
    sh = p.share
    return sh is not None and p.train.pad == 0 and sh.rollout_offset == 0 and sh.buffer_numel == p.rollout.numel


def realised(model_plan: ModelPlan) -> ModelPlan:
    """The plan with every share that is not `in_place` replaced by copies of the whole rollout tensor
    (the rank's own elements by a local copy): the plan `rollplex.parallel.shared_weights` runs."""
    plans = {}
    for sig, per_rank in model_plan.plans.items():
        trains = [p.train for p in per_rank]
        plans[sig] = tuple(p if p.share is None or in_place(p) else
                           plan_param(p.rollout, p.train, _sources(r, model_plan.nodes, trains), share=False)
                           for r, p in enumerate(per_rank))
    return replace(model_plan, plans=plans)


def engine_mapping(specs: Sequence[ParamSpec], world: int, tp: int, share: bool = True,
                   vision_tp: bool = False) -> Mapping:
    """The rank mapping a colocated runtime can realise with FSDP over every rank (rank r holds chunk r)
    and rollout engines of `tp` ranks it may group freely (a rank's TP rank is its position in its
    engine's group): the digit interleaving of (g, t) into the rank that shares the most under
    `realised`, consecutive engines on a tie."""
    best, best_shared = None, -1
    for name, slot_of in interleavings(world, tp):  # consecutive engines first
        m = Mapping(name, slot_of, None)
        p = realised(plan(specs, runtime_train_layout(world, tp), RolloutLayout(tp, vision_tp), share=share,
                          mapping=m))
        shared = sum(p.counts[sig] * q.shared_numel for sig, per_rank in p.plans.items() for q in per_rank)
        if shared > best_shared:
            best, best_shared = m, shared
    return best
