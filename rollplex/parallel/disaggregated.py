"""The `disaggregated` layout: trainer and rollout on separate ranks, weights broadcast after each update.

This is the baseline Rollplex is measured against (OpenRLHF's and verl's separate-placement mode): at
the same GPU budget, `train` ranks hold the actor sharded by FSDP2 (data-parallel over prompt groups,
data_parallel.py) and `replicas` rollout engines of `rollout_tp` ranks each hold a full copy of the
policy, tensor-parallel (tp.py). One RL step runs

    rollout ranks   generate the batch (each replica its share of the prompts)
    all ranks       the batch reaches the trainer ranks (object collective / the driver)
    trainer ranks   reference scoring + actor update; the rollout ranks wait (idle GPUs: the cost
                    this layout pays, against colocation's shared GPUs)
    all ranks       `sync_weights`: the trainer's full weights broadcast to every rollout rank

Ranks: [0, train) train, then replica r's TP ranks [train + r * rollout_tp, train + (r + 1) *
rollout_tp). The weights leave trainer rank 0 (after gathering its FSDP shards with the other
trainer ranks) over a sync group holding it and every rollout rank, in the rollout's dtype
(broadcast.py); each rollout rank copies its TP shard into the engine's live parameters in place.

Colocated layouts (Rollplex's own mode) keep trainer and engine on the same ranks and share or
rebuild the rollout shards in place instead of broadcasting (`rollplex.weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .broadcast import DEFAULT_BUCKET_BYTES, receive_weights, send_weights
from .fsdp import DTYPES
from .tp import TPPlan


@dataclass(frozen=True)
class DisaggregatedLayout:
    train: int  # trainer ranks (one FSDP2 mesh)
    rollout_tp: int = 1  # tensor-parallel degree of each rollout engine
    replicas: int = 1  # rollout engines
    wire_dtype: str = "bfloat16"  # dtype of the broadcast weights: the rollout model's
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def __post_init__(self):
        if min(self.train, self.rollout_tp, self.replicas) < 1:
            raise ValueError(f"train, rollout_tp and replicas must be >= 1: {self}")
        if self.wire_dtype not in DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(DTYPES)}, got {self.wire_dtype!r}")
        if self.bucket_bytes < 1:
            raise ValueError("bucket_bytes must be >= 1")

    @property
    def world(self) -> int:
        return self.train + self.rollout_tp * self.replicas

    @property
    def train_ranks(self) -> list[int]:
        return list(range(self.train))

    def replica_ranks(self, r: int) -> list[int]:
        first = self.train + r * self.rollout_tp
        return list(range(first, first + self.rollout_tp))

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.train, self.world))

    def role(self, rank: int) -> str:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside the layout's {self.world} ranks")
        return "train" if rank < self.train else "rollout"


@dataclass
class Disaggregated:
    """This rank's groups in a DisaggregatedLayout (`init_disaggregated`)."""

    layout: DisaggregatedLayout
    rank: int
    train_mesh: DeviceMesh | None  # the FSDP mesh (trainer ranks)
    tp_group: dist.ProcessGroup | None  # this rank's rollout engine (rollout ranks)
    replica: int | None  # which rollout engine (rollout ranks)
    sync_group: dist.ProcessGroup | None  # trainer rank 0 + every rollout rank

    @property
    def role(self) -> str:
        return self.layout.role(self.rank)

    @property
    def src(self) -> int:
        return self.layout.train_ranks[0]

    def sync_weights(self, model: nn.Module, tp: TPPlan | None = None) -> None:
        """After an update: trainer ranks send `model`'s weights, rollout ranks receive them into theirs
        (tp: the plan a rollout rank's model was split by). Every rank of the layout calls it."""
        dtype, b = DTYPES[self.layout.wire_dtype], self.layout.bucket_bytes
        if self.role == "train":
            send_weights(model, self.sync_group, self.src, dtype, b)
        else:
            receive_weights(model, self.sync_group, self.src, dtype, b, tp)


def init_disaggregated(layout: DisaggregatedLayout, device_type: str = "cpu") -> Disaggregated:
    """Create the layout's process groups (a collective: every rank calls it, after
    `init_process_group` over exactly `layout.world` ranks)."""
    if dist.get_world_size() != layout.world:
        raise ValueError(f"the layout needs {layout.world} ranks, the process group has {dist.get_world_size()}")
    rank = dist.get_rank()
    # new_group is collective over the whole world and must be called in the same order everywhere
    train = dist.new_group(layout.train_ranks)
    tp_groups = [dist.new_group(layout.replica_ranks(r)) for r in range(layout.replicas)]
    sync = dist.new_group([layout.train_ranks[0], *layout.rollout_ranks])
    if layout.role(rank) == "train":
        return Disaggregated(layout, rank, DeviceMesh.from_group(train, device_type), None, None,
                             sync if rank == layout.train_ranks[0] else None)
    r = (rank - layout.train) // layout.rollout_tp
    return Disaggregated(layout, rank, None, tp_groups[r], r, sync)
