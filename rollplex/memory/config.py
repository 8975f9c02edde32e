"""Memory configuration, and the sizes the automatic plan is chosen from."""

from __future__ import annotations

from dataclasses import dataclass

from .fit import OPTIMIZER_OFFLOADS, Estimate, MemoryFit, fit
from .plan import PhasePlan

PLANS = ("auto", "resident", "release")


@dataclass(frozen=True)
class MemoryConfig:
    # auto: the cheapest plan that fits the device (releases, then the measures of fit.py by cost); resident:
    # nothing moves (memory management off); release: drop the KV cache outside rollout and gradients outside update
    memory_plan: str = "auto"
    # comma-separated tag:phase=residency applied on top, e.g. "ref_weights:*=offloaded"
    memory_overrides: str | None = None
    memory_backend: str = "auto"  # auto: torch-memory-saver on CUDA when installed, else accounting; tms; accounting
    # optimizer state in pinned host memory, paged through the device chunk by chunk during the optimizer
    # step, for models whose optimizer state does not fit beside the rest: none; moments (the two AdamW
    # moments, 8 bytes per parameter); all (the fp32 masters too, 12 bytes per parameter); cpu (all of it on the
    # host, and the AdamW step runs there); auto: none, unless the plan needs moments or all to fit the device
    optimizer_offload: str = "auto"
    memory_budget: float = 0.92  # share of the device's memory the plan may fill
    # the device memory the plan is sized against; None: the device's total memory on CUDA, unlimited on CPU
    # (where nothing is checked) unless the memory backend plays a device of some capacity
    device_capacity_gib: float | None = None

    def __post_init__(self):
        if self.memory_plan not in PLANS:
            raise ValueError(f"memory_plan must be one of {PLANS}, got {self.memory_plan!r}")
        if self.memory_backend not in ("auto", "tms", "accounting"):
            raise ValueError("memory_backend must be auto, tms or accounting")
        if self.optimizer_offload not in OPTIMIZER_OFFLOADS:
            raise ValueError(f"optimizer_offload must be one of {OPTIMIZER_OFFLOADS}, got {self.optimizer_offload!r}")
        if not 0.1 <= self.memory_budget <= 1.0:
            raise ValueError("memory_budget must be in [0.1, 1]")
        if self.device_capacity_gib is not None and not self.device_capacity_gib > 0:
            raise ValueError("device_capacity_gib must be > 0 (or None: the device's own)")
        if self.memory_overrides:
            PhasePlan.releases_only().with_overrides(self.memory_overrides)  # validates the spec

    def fit(self, estimate: Estimate, capacity: int | None, gradient_checkpointing: bool | None = None,
            vision_gradient_checkpointing: bool | None = None, detail: str = "",
            host_capacity: int | None = None) -> MemoryFit:
        """The plan and trainer settings for a device of `capacity` bytes (None: unchecked), from `estimate`
        (checkpointing, optimizer_offload) -> (bytes per tag, activations per phase); the checkpointing
        flags as the user gave them (None: the plan's to choose). See fit.py; ValueError when nothing fits."""
        return fit(estimate, capacity, memory_plan=self.memory_plan, memory_overrides=self.memory_overrides,
                   memory_budget=self.memory_budget, gradient_checkpointing=gradient_checkpointing,
                   vision_gradient_checkpointing=vision_gradient_checkpointing,
                   optimizer_offload=self.optimizer_offload, detail=detail, host_capacity=host_capacity)

    @property
    def managed(self) -> bool:
        """False for the `resident` plan: nothing moves, so no manager (and no region allocator) is used."""
        return self.memory_plan != "resident" or bool(self.memory_overrides)


def activation_bytes(hidden: int, layers: int, tokens: int, dtype_bytes: int, checkpointing: bool,
                     intermediate: int | None = None) -> int:
    """A coarse upper estimate of what one forward/backward of `tokens` tokens keeps for backward.

    Per token and decoder layer, without checkpointing: with the MLP width `intermediate`, about 8
    hidden-sized values (the residual, normed inputs, q/k/v, attention output) and 3 intermediate-sized
    ones (gate, up, their SiLU product) — W3B's defaults measured 129.1 GiB of update peak against
    126.6 planned with it (rl/step.py, docs/BENCHMARKS.md); without it, 14 hidden-sized values (the layer glue
    alone). With per-layer checkpointing only the layer inputs stay, plus one layer's worth recomputed
    during backward. Used only to pick a plan; the ledger reports what was measured."""
    per_layer = (14 * hidden if intermediate is None else 8 * hidden + 3 * intermediate) * dtype_bytes
    if checkpointing:
        return tokens * (layers * hidden * dtype_bytes + per_layer)
    return tokens * layers * per_layer
