"""What a plan buys: bytes shared and rebuilt per rank, memory saved, an estimated rebuild time.

Per rank, in the rollout dtype: `rollout` is the rank's rollout shard, what a naive hybrid engine
pays for its second copy; `extra` what it pays with sharing (the joint buffer beyond the training
shard); `rebuilt` = rollout - shared, split into `local` (copied from the rank's own training
shard) and bytes received from ranks on the same node / other nodes.

The rebuild time is an ESTIMATE, not a measurement: per rank, local bytes read and written at HBM
bandwidth, plus the busier direction of its intra-node traffic over NVLink and of its inter-node
traffic over its NIC, each at the stated bandwidth (`Links`), with no latency and perfect overlap of
a rank's concurrent transfers; the step's estimate is the slowest rank's.

The per-GPU footprint adds the training state of each rank's shard as Rollplex's MasterAdamW keeps
it: bf16 weights and gradient buffers, fp32 master weights and AdamW's two fp32 moments (16 bytes per
parameter). Activations, KV cache, FSDP's gathered layers and allocator slack come on top and are
not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from .planner import ModelPlan

GIB = 2**30
TRAIN_STATE_BYTES = {"bf16 weights": 2, "bf16 grads": 2, "fp32 master": 4, "AdamW m+v": 8}


@dataclass(frozen=True)
class Links:
    """Assumed bandwidths in GB/s per GPU and direction (H200 defaults: NVLink, one 400 Gb/s NIC
    per GPU, HBM copy rate)."""

    intra_gbs: float = 360.0
    inter_gbs: float = 50.0
    hbm_gbs: float = 4000.0

    def __post_init__(self):
        if min(self.intra_gbs, self.inter_gbs, self.hbm_gbs) <= 0:
            raise ValueError(f"bandwidths must be positive: {self}")


@dataclass
class RankBytes:
    train: int = 0  # the padded training shard, in the rollout dtype
    rollout: int = 0
    shared: int = 0
    extra: int = 0
    local: int = 0
    intra_in: int = 0
    inter_in: int = 0
    intra_out: int = 0
    inter_out: int = 0

    @property
    def rebuilt(self) -> int:
        return self.rollout - self.shared

    @property
    def remote(self) -> int:
        return self.intra_in + self.inter_in

    def seconds(self, links: Links) -> float:
        return (2 * self.local / links.hbm_gbs + max(self.intra_in, self.intra_out) / links.intra_gbs
                + max(self.inter_in, self.inter_out) / links.inter_gbs) / 1e9


def rank_bytes(plan: ModelPlan, dtype_bytes: int = 2) -> list[RankBytes]:
    out = [RankBytes() for _ in range(plan.world)]
    for sig, per_rank in plan.plans.items():
        n = plan.counts[sig] * dtype_bytes
        for r, p in enumerate(per_rank):
            b = out[r]
            b.train += n * p.train.padded_numel
            b.rollout += n * p.rollout.numel
            b.shared += n * p.shared_numel
            b.extra += n * p.extra_numel
            for c in p.copies:
                if c.src == r:
                    b.local += n * c.numel
                elif plan.nodes[c.src] == plan.nodes[r]:
                    b.intra_in += n * c.numel
                    out[c.src].intra_out += n * c.numel
                else:
                    b.inter_in += n * c.numel
                    out[c.src].inter_out += n * c.numel
    for b in out:
        assert b.rebuilt == b.local + b.remote, b
    return out


@dataclass(frozen=True)
class Summary:
    plan: ModelPlan
    ranks: tuple[RankBytes, ...]
    links: Links
    dtype_bytes: int

    @classmethod
    def of(cls, plan: ModelPlan, links: Links = Links(), dtype_bytes: int = 2) -> Summary:
        return cls(plan, tuple(rank_bytes(plan, dtype_bytes)), links, dtype_bytes)

    def max(self, field: str) -> int:
        return max(getattr(b, field) for b in self.ranks)

    @property
    def saved(self) -> float:
        """Fraction of the naive rollout copies (all ranks) that sharing saves."""
        return 1 - sum(b.extra for b in self.ranks) / sum(b.rollout for b in self.ranks)

    @property
    def est_ms(self) -> float:
        return 1e3 * max(b.seconds(self.links) for b in self.ranks)

    @property
    def mapping_label(self) -> str:
        """The mapping's name; * below the best over all mappings, + not node-local."""
        c = self.plan.choice
        return c.mapping.name + ("" if c.optimal else "*") + ("" if c.mapping.node_of else "+")

    def footprint(self) -> dict[str, float]:
        """GiB per GPU (each term's largest rank; the totals are the largest rank's total): the
        training state, the naive rollout copy and the rollout copy's extra memory with sharing."""
        state = sum(TRAIN_STATE_BYTES.values())
        out = {k: self.max("train") // self.dtype_bytes * v / GIB for k, v in TRAIN_STATE_BYTES.items()}
        out["training"] = max(b.train // self.dtype_bytes * state for b in self.ranks) / GIB
        out["rollout copy"] = self.max("rollout") / GIB
        out["rollout extra"] = self.max("extra") / GIB
        out["total naive"] = max(b.train // self.dtype_bytes * state + b.rollout for b in self.ranks) / GIB
        out["total shared"] = max(b.train // self.dtype_bytes * state + b.extra for b in self.ranks) / GIB
        return out
