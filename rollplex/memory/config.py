"""Memory configuration, and the sizes the automatic plan is chosen from."""

from __future__ import annotations

from dataclasses import dataclass

from .plan import PhasePlan

PLANS = ("auto", "resident", "release")


@dataclass(frozen=True)
class MemoryConfig:
    # auto: the cheapest plan that fits the device (releases, then offloads by copy cost); resident: nothing
    # moves (memory management off); release: drop the KV cache outside rollout and gradients outside update
    memory_plan: str = "auto"
    # comma-separated tag:phase=residency applied on top, e.g. "ref_weights:*=offloaded"
    memory_overrides: str | None = None
    memory_backend: str = "auto"  # auto: torch-memory-saver on CUDA when installed, else accounting; tms; accounting
    # optimizer state in pinned host memory, paged through the device chunk by chunk during the optimizer
    # step, for models whose optimizer state does not fit beside the rest: none; moments (the two AdamW
    # moments, 8 bytes per parameter); all (the fp32 masters too, 12 bytes per parameter); cpu (all of it on the
    # host, and the AdamW step runs there)
    optimizer_offload: str = "none"
    memory_budget: float = 0.92  # share of the device's memory the automatic plan may fill

    def __post_init__(self):
        if self.memory_plan not in PLANS:
            raise ValueError(f"memory_plan must be one of {PLANS}, got {self.memory_plan!r}")
        if self.memory_backend not in ("auto", "tms", "accounting"):
            raise ValueError("memory_backend must be auto, tms or accounting")
        if self.optimizer_offload not in ("none", "moments", "all", "cpu"):
            raise ValueError(f"optimizer_offload must be none, moments, all or cpu, got {self.optimizer_offload!r}")
        if not 0.1 <= self.memory_budget <= 1.0:
            raise ValueError("memory_budget must be in [0.1, 1]")
        if self.memory_overrides:
            PhasePlan.releases_only().with_overrides(self.memory_overrides)  # validates the spec

    def build_plan(self, sizes: dict[str, int], activations: dict[str, int], capacity: int) -> PhasePlan:
        if self.memory_plan == "resident":
            plan = PhasePlan.all_resident()
        elif self.memory_plan == "release":
            plan = PhasePlan.releases_only()
        else:
            plan = PhasePlan.auto(sizes, activations, int(capacity * self.memory_budget))
        return plan.with_overrides(self.memory_overrides)

    @property
    def managed(self) -> bool:
        """False for the `resident` plan: nothing moves, so no manager (and no region allocator) is used."""
        return self.memory_plan != "resident" or bool(self.memory_overrides)


def activation_bytes(hidden: int, layers: int, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """A coarse upper estimate of what one forward/backward of `tokens` tokens keeps for backward.

    Per token and decoder layer about 14 hidden-sized values are saved without checkpointing with the
    compiled layer glue (the residual, normed input, q/k/v and attention output, the MLP's gate/up
    product, its activation); with per-layer checkpointing only the layer inputs stay, plus one layer's
    worth recomputed during backward. Used only to pick a plan; the ledger reports what was measured."""
    per_layer = 14 * hidden * dtype_bytes
    if checkpointing:
        return tokens * (layers * hidden * dtype_bytes + per_layer)
    return tokens * layers * per_layer
