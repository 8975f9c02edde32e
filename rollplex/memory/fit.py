"""Fitting the RL step to its device: the measures the memory plan takes, cheapest first.

The step's planned peak per phase is the bytes of the regions resident in it plus the activation
estimate (rl/step_memory.py: `update_activations`); it must stay within `memory_budget` x the device's
capacity (`manager.device_capacity`). Releasing — the KV cache outside rollout, gradients outside
update — costs nothing and is always part of the `auto` plan. While a phase is over the budget,
`fit` takes the next measure of this ladder, skipping one that lowers no phase over the budget:

| measure | what changes | cost per W3B step on one H200 (docs/BENCHMARKS.md) |
|---|---|---|
| reference offloaded | ref_weights offloaded outside `ref` | a copy of the frozen weights in: 0.15 s |
| critic offloaded | critic_weights in `rollout`, critic_optimizer outside `update_critic` | the critic's copies |
| activation checkpointing | (vision_)gradient_checkpointing | one more forward: update 6.65 -> 7.44 s |
| optimizer_offload=moments | AdamW moments paged from host memory | 16 bytes per parameter over the bus: +1.1 s |
| optimizer_offload=all | the fp32 masters paged too | 24 bytes per parameter: about +1.6 s (by the bytes) |
| optimizer offloaded | the actor's optimizer offloaded outside `update` (and `update_critic`) | 42 GiB out, in: 4.5 s |

The last one only moves what `optimizer_offload` left on the device (a user's `none` or `moments`).
`optimizer_offload=cpu` is never chosen: it frees no more device memory than `all`, for an AdamW
step on the host that costs 8.3 s per step. Once the step fits, the reference's offload, when taken
before the last measure, is dropped again if the step still fits without it (the 7B preset:
checkpointing and paged moments make it unneeded; with it, 77 GiB pinned, the process was killed on
the H200 machine's 128 GiB host). The host memory it all pins (offloaded regions and
paged optimizer state) must stay within `host_budget` of the host's RAM: PyTorch's pinned allocator rounds
allocations up, so the share is kept well below one.

A choice made by the user is never changed: a gradient_checkpointing flag given (True or False),
an optimizer_offload other than `auto`, a memory_plan other than `auto` (no offload is added to it),
memory_overrides (applied on top of every candidate). Their measures are skipped; when the rest do
not make the step fit, the ValueError says which were kept as given, the phases over the budget
and what would be needed. Without a capacity (CPU, unless one is given) nothing is checked and no
measure is taken. The choice is made once, when the step is built, from planned sizes (step_memory.py
plans a region at least at the bytes it already maps: a region's pool keeps what an earlier owner
mapped, and a smaller owner does not give it back). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .plan import PHASES, PhasePlan

GiB = 2**30
# measures that only move a region to host memory: dropped again once a later measure makes them unneeded.
# Checkpointing is never dropped for a later one: the activation estimate is the plan's least certain
# number (the 7B update planned 83.9 GiB and measured 90.5 with checkpointing and paged moments).
HOST_ONLY = ("reference offloaded", "critic offloaded")
OPTIMIZER_OFFLOADS = ("auto", "none", "moments", "all", "cpu")

# (checkpointing, optimizer_offload) -> (bytes per tag, transient bytes per phase)
Estimate = Callable[[bool, str], tuple[dict[str, int], dict[str, int]]]


def optimizer_bytes(trainable: int, fp32_params: bool, offload: str) -> int:
    """Device bytes of the optimizer region at steady state: fp32 masters (fp32 parameters are their
    own) and the two AdamW moments, less what `offload` keeps in host memory."""
    masters = 0 if fp32_params else 4 * trainable
    return {"none": masters + 8 * trainable, "moments": masters, "all": 0, "cpu": 0}[offload]


@dataclass(frozen=True)
class Footprint:
    """What the step's region sizes are planned from: bytes of the policy (what the engine decodes, plus
    trainer tensors stored apart from it), of the reference and of the KV cache; the trainable
    parameters this process steps and their bytes each (4: fp32, their own masters); the critic's
    (PPO-GAE) bytes and trainable parameters, 0 without one (its optimizer offloaded like the actor's)."""

    weights: int
    ref_weights: int
    kv_cache: int
    trainable: int
    param_bytes: int
    critic_weights: int = 0
    critic_trainable: int = 0

    def sizes(self, optimizer_offload: str) -> dict[str, int]:
        return {"weights": self.weights, "ref_weights": self.ref_weights, "kv_cache": self.kv_cache,
                "optimizer": optimizer_bytes(self.trainable, self.param_bytes == 4, optimizer_offload),
                "grads": self.trainable * self.param_bytes, "critic_weights": self.critic_weights,
                "critic_optimizer": optimizer_bytes(self.critic_trainable, self.param_bytes == 4, optimizer_offload),
                "critic_grads": self.critic_trainable * self.param_bytes}


@dataclass(frozen=True)
class MemoryFit:
    """The plan and the trainer's settings chosen for the device, and what they were planned from."""

    plan: PhasePlan
    gradient_checkpointing: bool
    vision_gradient_checkpointing: bool
    optimizer_offload: str
    measures: tuple[str, ...] = ()  # taken, in order
    sizes: dict[str, int] = field(default_factory=dict)
    activations: dict[str, int] = field(default_factory=dict)
    capacity: int | None = None  # None: not checked
    budget: int | None = None

    def peaks(self) -> dict[str, int]:
        return {p: self.plan.peak(p, self.sizes, self.activations) for p in PHASES}

    def summary(self) -> str:
        taken = ", ".join(self.measures) or "none needed"
        peaks = " / ".join(f"{v / GiB:.1f}" for v in self.peaks().values())
        room = ("capacity not checked" if self.budget is None else
                f"budget {self.budget / GiB:.1f} GiB of {self.capacity / GiB:.1f} GiB")
        return (f"plan '{self.plan.name}'; measures: {taken}; gradient_checkpointing={self.gradient_checkpointing}, "
                f"vision_gradient_checkpointing={self.vision_gradient_checkpointing}, optimizer_offload="
                f"{self.optimizer_offload}; planned peak GiB {' / '.join(PHASES)} {peaks} ({room})")

    def to_dict(self) -> dict:
        gib = lambda n: None if n is None else round(n / GiB, 2)  # noqa: E731
        return {"measures": list(self.measures), "gradient_checkpointing": self.gradient_checkpointing,
                "vision_gradient_checkpointing": self.vision_gradient_checkpointing,
                "optimizer_offload": self.optimizer_offload, "capacity_gib": gib(self.capacity),
                "budget_gib": gib(self.budget), "planned_peak_gib": {p: gib(v) for p, v in self.peaks().items()}}


@dataclass(frozen=True)
class _State:
    plan: PhasePlan  # before the user's overrides
    checkpointing: bool
    vision_checkpointing: bool
    optimizer_offload: str


def fit(estimate: Estimate, capacity: int | None, *, memory_plan: str = "auto", memory_overrides: str | None = None,
        memory_budget: float = 0.92, gradient_checkpointing: bool | None = None,
        vision_gradient_checkpointing: bool | None = None, optimizer_offload: str = "auto",
        detail: str = "", host_capacity: int | None = None, host_budget: float = 0.6) -> MemoryFit:
    """The cheapest plan and trainer settings whose planned peaks fit `memory_budget` x `capacity` bytes
    (see the module docstring). None arguments and `auto` are the plan's to choose; `detail` (what the
    activation estimate was made from) goes into the error. ValueError when nothing fits, or when what fits
    needs more than `host_budget` x `host_capacity` bytes (None: unchecked) of pinned host memory."""
    if optimizer_offload not in OPTIMIZER_OFFLOADS:
        raise ValueError(f"optimizer_offload must be one of {OPTIMIZER_OFFLOADS}, got {optimizer_offload!r}")
    base = {"auto": PhasePlan.releases_only(), "release": PhasePlan.releases_only(),
            "resident": PhasePlan.all_resident()}[memory_plan]
    state = _State(PhasePlan(base.residency, name=memory_plan), bool(gradient_checkpointing),
                   bool(vision_gradient_checkpointing), "none" if optimizer_offload == "auto" else optimizer_offload)

    def evaluate(s: _State):
        sizes, acts = estimate(s.checkpointing, s.optimizer_offload)
        return s.plan.with_overrides(memory_overrides), sizes, acts

    def result(s: _State, taken: list[str], budget: int | None) -> MemoryFit:
        plan, sizes, acts = evaluate(s)
        if taken:
            plan = PhasePlan(plan.residency, name=f"{plan.name} ({', '.join(taken)})")
        return MemoryFit(plan, s.checkpointing, s.vision_checkpointing, s.optimizer_offload, tuple(taken), sizes,
                         acts, capacity, budget)

    if capacity is None:
        return result(state, [], None)
    budget = int(capacity * memory_budget)
    offloads = memory_plan == "auto"
    ladder: list[tuple[str, Callable[[_State], _State | None]]] = [
        ("reference offloaded", lambda s: replace(s, plan=s.plan.with_residency("ref_weights", "offloaded"))
         if offloads else None),
        # PPO-GAE's value model: its weights in the rollout, its AdamW state outside its own update (one copy out
        # and back per step either way)
        ("critic offloaded", lambda s: replace(s, plan=s.plan.with_residency(
            "critic_weights", "offloaded", ["rollout"]).with_residency("critic_optimizer", "offloaded"))
         if offloads else None),
        ("activation checkpointing", lambda s: replace(
            s, checkpointing=s.checkpointing if gradient_checkpointing is not None else True,
            vision_checkpointing=s.vision_checkpointing if vision_gradient_checkpointing is not None else True)
         if gradient_checkpointing is None or vision_gradient_checkpointing is None else None),
        ("optimizer_offload=moments", lambda s: replace(s, optimizer_offload="moments")
         if optimizer_offload == "auto" else None),
        ("optimizer_offload=all", lambda s: replace(s, optimizer_offload="all")
         if optimizer_offload == "auto" else None),
        ("optimizer offloaded", lambda s: replace(s, plan=s.plan.with_residency("optimizer", "offloaded"))
         if offloads else None),
    ]
    taken: list[str] = []
    state0 = state
    plan, sizes, acts = evaluate(state)
    for name, measure in ladder:
        over = [p for p in PHASES if plan.peak(p, sizes, acts) > budget]
        if not over:
            break
        nxt = measure(state)
        if nxt is None:
            continue
        nplan, nsizes, nacts = evaluate(nxt)
        if any(nplan.peak(p, nsizes, nacts) < plan.peak(p, sizes, acts) for p in over):
            state, plan, sizes, acts = nxt, nplan, nsizes, nacts
            taken.append(name)
    over = {p: plan.peak(p, sizes, acts) for p in PHASES if plan.peak(p, sizes, acts) > budget}
    if not over and len(taken) > 1:  # drop an offload a later measure made unneeded (host memory, copies)
        steps = dict(ladder)

        def replay(names: list[str]) -> _State:
            s = state0
            for n in names:
                s = steps[n](s)
            return s

        for name in [n for n in taken[:-1] if n in HOST_ONLY]:
            keep = [n for n in taken if n != name]
            s = replay(keep)
            nplan, nsizes, nacts = evaluate(s)
            if all(nplan.peak(p, nsizes, nacts) <= budget for p in PHASES):
                state, plan, sizes, acts, taken = s, nplan, nsizes, nacts, keep
    if not over and host_capacity is not None:
        # pinned host memory: the optimizer state `optimizer_offload` keeps there, and every region offloaded
        none = estimate(state.checkpointing, "none")[0]
        host = none["optimizer"] - sizes["optimizer"] + none["critic_optimizer"] - sizes["critic_optimizer"] + sum(
            n for tag, n in sizes.items() if any(plan.get(p, tag) == "offloaded" for p in PHASES))
        if host > host_capacity * host_budget:
            raise ValueError(
                f"the RL step fits the device only with {host / GiB:.1f} GiB of it in pinned host memory "
                f"({', '.join(taken) or 'as given'}), over {host_budget} x the host's {host_capacity / GiB:.1f} GiB "
                "(pinned allocations round up): fewer tokens per update micro-batch, a smaller KV cache "
                "(gpu_memory_utilization, kv_cache_tokens), or more GPUs (torchrun, FSDP)")
    if over:
        raise ValueError(_no_fit(over, plan, sizes, acts, capacity, budget, memory_budget, taken, detail, {
            "gradient_checkpointing": gradient_checkpointing,
            "vision_gradient_checkpointing": vision_gradient_checkpointing,
            "optimizer_offload": None if optimizer_offload == "auto" else optimizer_offload,
            "memory_plan": None if memory_plan == "auto" else memory_plan, "memory_overrides": memory_overrides}))
    return result(state, taken, budget)


def _no_fit(over, plan, sizes, acts, capacity, budget, share, taken, detail, given) -> str:
    gib = lambda n: f"{n / GiB:.1f} GiB"  # noqa: E731
    phases = ", ".join(f"{p} {gib(v)} ({gib(v - budget)} over)" for p, v in over.items())
    regions = max(plan.resident_bytes(p, sizes) for p in over)
    kept = ", ".join(f"{k}={v}" for k, v in given.items() if v is not None)
    lines = [f"the RL step does not fit the device: planned peak of {phases} against a budget of {gib(budget)} "
             f"(memory_budget {share} x {gib(capacity)})",
             "measures taken: " + (", ".join(taken) or "none") + "; kept as given: " + (kept or "nothing")]
    if regions > budget:
        lines.append(f"the resident regions alone need {gib(regions)}: lower the KV cache (gpu_memory_utilization, "
                     "kv_cache_tokens), or shard the model over more GPUs (torchrun, FSDP)")
    else:
        lines.append(f"the activations need {gib(max(acts.get(p, 0) for p in over))}, "
                     f"{gib(budget - regions)} is left for them"
                     + (f" ({detail})" if detail else "")
                     + ": fewer tokens per update micro-batch (micro_batch_prompts, micro_batch_max_tokens, "
                     "max_new_tokens, n), or more GPUs (torchrun, FSDP)")
    if kept:
        lines.append("leave the choices given to the plan (gradient_checkpointing unset, optimizer_offload=auto, "
                     "memory_plan=auto) so that it may take the measures they exclude")
    lines.append(f"a larger memory_budget (now {share}) lets the plan fill more of the device")
    return "\n".join(lines) + "\n" + plan.table(sizes, acts)
