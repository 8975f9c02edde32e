"""Parallel layouts: where each parameter's elements live under tensor parallelism, FSDP2, or both.

A `ParamSpec` says how tensor parallelism cuts a parameter (Megatron style), independent of the
degree:

    tp_dim None   Replicate: norms, row-parallel biases, whatever a policy keeps whole
    tp_dim 0      Shard(0) of every fused part separately: column-parallel q/k/v and gate/up (and
                  their biases), vocab-parallel embedding and head. The part [q; k; v] of rank t is
                  [q_t; k_t; v_t], not rows t/tp of the fused matrix.
    tp_dim 1      Shard(1): row-parallel o_proj / down_proj (input features)

Each part splits into whole units (heads, features). When the degree exceeds the unit count of a
`replicable` part (KV heads: 7B has 4) and divides it, ranks share units: rank t holds unit
t // (tp // units), the KV-head replication vLLM does. Any other mismatch (28 query heads over 8
ranks) is a ValueError.

`TrainLayout(tp, fsdp, rep)` is the training mesh [rep, fsdp, tp] (tp innermost): each rank's tensor
is FSDP2's Shard(0) of its TP shard (what `fully_shard` does to a TP DTensor's local tensor), HSDP
replicas when rep > 1. `block` > 1 stores each parameter in *blocked order*: the TP-`block` shards
one after the other (rows [q_0; k_0; v_0; q_1; ...]; a row-parallel weight as its column blocks
stacked, [block * rows, cols / block]), so FSDP's dim-0 chunks line up with rollout TP shards. The
trainer then reads the parameter through that order: for qkv / gate_up the GEMM output features come
out interleaved per block (a view split and one activation re-layout), for o / down the gathered
weight is re-laid out (or multiplied block by block).

`RolloutLayout(tp)`: the engine's TP layout. Rollout slot g * tp + t is TP rank t of rollout group g.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .regions import Rect, Region, fsdp_chunk


@dataclass(frozen=True)
class Part:
    """A segment of the sharded dim: `size` rows or columns made of `units` equal units; a
    `replicable` part (KV heads) may be spread over more ranks than it has units."""

    size: int
    units: int
    replicable: bool = False

    def __post_init__(self):
        if self.units < 1 or self.size % self.units:
            raise ValueError(f"part of size {self.size} is not made of {self.units} equal units")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    parts: tuple[Part, ...] = ()
    tower: str = "text"  # "text" or "vision": layouts may replicate the vision tower under TP

    def __post_init__(self):
        if self.tp_dim not in (None, 0, 1) or self.tower not in ("text", "vision"):
            raise ValueError(f"{self.name}: bad tp_dim {self.tp_dim} / tower {self.tower!r}")
        if self.tp_dim is not None:
            if self.tp_dim == 1 and (len(self.shape) != 2 or len(self.parts) != 1):
                raise ValueError(f"{self.name}: row-parallel needs a 2-D weight with one part")
            if sum(p.size for p in self.parts) != self.shape[self.tp_dim]:
                raise ValueError(f"{self.name}: parts {self.parts} do not add up to dim {self.tp_dim} of {self.shape}")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def placement(self) -> str:
        if self.tp_dim is None:
            return "Replicate"
        if len(self.parts) > 1:
            return f"FusedShard({self.tp_dim}; " + " | ".join(f"{p.size}/{p.units}" for p in self.parts) + ")"
        return f"Shard({self.tp_dim})"

    def signature(self) -> tuple:
        """What the planner's result depends on: equal signatures plan alike (the layers repeat)."""
        return (self.shape, self.tp_dim, self.parts, self.tower)


def _unit_range(part: Part, tp: int, t: int) -> tuple[int, int]:
    """[first, end) offsets inside `part` held by TP rank t of tp."""
    unit = part.size // part.units
    if part.units % tp == 0:
        per = part.units // tp
        return t * per * unit, (t + 1) * per * unit
    if part.replicable and tp % part.units == 0:
        u = t // (tp // part.units)
        return u * unit, (u + 1) * unit
    raise ValueError(f"{part.units} {'replicable ' * part.replicable}units cannot be split over "
                     f"tensor-parallel degree {tp}")


def tp_rects(spec: ParamSpec, tp: int, t: int) -> list[Rect]:
    """Rectangles held by TP rank t of tp, in the TP shard's local order."""
    if not 0 <= t < tp:
        raise ValueError(f"TP rank {t} out of range for degree {tp}")
    if spec.tp_dim is None or tp == 1:
        return [Rect(0, spec.rows, 0, spec.cols)]
    if spec.tp_dim == 1:
        a, b = _unit_range(spec.parts[0], tp, t)
        return [Rect(0, spec.rows, a, b)]
    out, off = [], 0
    for p in spec.parts:
        a, b = _unit_range(p, tp, t)
        out.append(Rect(off + a, off + b, 0, spec.cols))
        off += p.size
    return out


def storage_region(spec: ParamSpec, tp: int, t: int, block: int = 1) -> Region:
    """TP rank t's local tensor (degree tp), stored in blocked order of degree `block` (1: as-is)."""
    if block == 1 or spec.tp_dim is None or tp == block:
        rects = tp_rects(spec, tp, t)
        return Region.of(rects, rects[0].width)
    if block % tp:
        raise ValueError(f"blocked storage degree {block} is not a multiple of the TP degree {tp}")
    per = block // tp
    rects: list[Rect] = []
    for sub in range(t * per, (t + 1) * per):
        rects.extend(r for r in tp_rects(spec, block, sub) if r not in rects)  # replicated KV heads once
    region = Region.of(rects, rects[0].width)
    assert region.numel == sum(r.numel for r in tp_rects(spec, tp, t)), (spec.name, tp, t, block)
    return region


def _shard_vision(spec: ParamSpec, vision_tp: bool) -> bool:
    return spec.tower == "text" or vision_tp


@dataclass(frozen=True)
class TrainLayout:
    """Training mesh [rep, fsdp, tp], tp innermost; rank = (rep_i * fsdp + s) * tp + u."""

    tp: int = 1
    fsdp: int = 1
    rep: int = 1
    block: int = 1
    vision_tp: bool = False
    block_vision: bool = False  # blocked order for the vision tower too (when rollout shards it)
    # FSDP shards the row-parallel weights (o, down) by columns, `Shard(1)`, where they split evenly and
    # training has no TP: rank s holds all rows x column window s, contiguous, which is exactly the TP
    # shard of a rollout engine of the same degree (`column_sharded`)
    column_shard: bool = False

    def __post_init__(self):
        if min(self.tp, self.fsdp, self.rep, self.block) < 1:
            raise ValueError(f"degrees must be >= 1: {self}")
        if self.block > 1 and self.block % self.tp:
            raise ValueError(f"blocked storage degree {self.block} must be a multiple of training TP {self.tp}")

    @property
    def world(self) -> int:
        return self.tp * self.fsdp * self.rep

    @property
    def label(self) -> str:
        parts = [f"TP {self.tp}"] if self.tp > 1 else []
        parts += [f"FSDP {self.fsdp}"] if self.fsdp > 1 or self.tp == 1 else []
        parts += [f"rep {self.rep}"] if self.rep > 1 else []
        return " x ".join(parts)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, fsdp shard, tp rank) of a training rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for world {self.world}")
        return rank // (self.tp * self.fsdp), (rank // self.tp) % self.fsdp, rank % self.tp

    def tp_group(self, rank: int) -> tuple[int, ...]:
        base = rank - rank % self.tp
        return tuple(range(base, base + self.tp))

    def column_sharded(self, spec: ParamSpec) -> bool:
        """Whether FSDP shards this parameter by columns (`column_shard`)."""
        return (self.column_shard and self.tp == 1 and spec.tp_dim == 1 and _shard_vision(spec, self.vision_tp)
                and spec.cols % self.fsdp == 0)

    def storage_rows(self, spec: ParamSpec) -> list[int] | None:
        """The parameter's row of each stored row, where training stores it whole in another row order
        (blocked order, training TP 1); None where the stored order is the parameter's."""
        if self.tp != 1 or self.column_sharded(spec) or spec.tp_dim != 0:
            return None
        block = self.block if _shard_vision(spec, self.block_vision) else 1
        rows = [i for r in storage_region(spec, 1, 0, block).rects for i in range(r.r0, r.r1)]
        return None if rows == list(range(spec.rows)) else rows

    def region(self, spec: ParamSpec, rank: int) -> Region:
        _, s, u = self.coords(rank)
        if self.column_sharded(spec):
            c = spec.cols // self.fsdp
            return Region.of([Rect(0, spec.rows, s * c, (s + 1) * c)], c)
        tp = self.tp if _shard_vision(spec, self.vision_tp) else 1
        block = self.block if _shard_vision(spec, self.block_vision) else 1
        local = storage_region(spec, tp, u if tp > 1 else 0, max(block, tp))
        return fsdp_chunk(local, self.fsdp, s)


def runtime_train_layout(world: int, rollout_tp: int) -> TrainLayout:
    """The training layout the colocated runtime uses (rollplex.parallel): FSDP over every rank. When one
    tensor-parallel engine spans the ranks, the row-parallel weights are sharded by columns and the other
    text weights stored in blocked order of the engine's degree (the fused q/k/v and gate/up rows grouped
    by TP shard: `storage_rows`), so every text TP shard of the engine is a rank's FSDP shard, byte for
    byte. Otherwise FSDP's row chunks of the weights as they are (several engines split coarser than FSDP
    does, and a per-rank engine's whole tensor holds the row chunks)."""
    one = 1 < rollout_tp == world
    return TrainLayout(fsdp=world, column_shard=one, block=rollout_tp if one else 1)


@dataclass(frozen=True)
class RolloutLayout:
    """The engine's TP layout; `vision_tp` False keeps the vision tower whole on every rank."""

    tp: int = 1
    vision_tp: bool = False

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"rollout TP degree must be >= 1, got {self.tp}")

    def region(self, spec: ParamSpec, t: int) -> Region:
        tp = self.tp if _shard_vision(spec, self.vision_tp) else 1
        rects = tp_rects(spec, tp, t if tp > 1 else 0)
        return Region.of(rects, rects[0].width)
