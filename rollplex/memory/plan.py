"""The phase plan: which memory regions are resident in which phase of an RL step.

An RL step moves through its phases — `rollout` (the engine decodes), `ref` (reference and old
logprobs, and a critic's values, are scored), `update` (the actor's forward/backward/optimizer) and,
with a critic, `update_critic` (the critic's) — and each large allocation lives in a tagged region
whose contents are needed only by some of them:

| tag | produced / read by |
|---|---|
| weights | the policy: the engine decodes with it, the trainer updates it (always resident) |
| ref_weights | the frozen reference model: read only in `ref` |
| kv_cache | the engine's paged KV cache: only in `rollout`; its contents never outlive a rollout |
| optimizer | the actor's AdamW moments + fp32 masters: only in `update`; mutable: a CPU copy is rewritten each step |
| grads | the actor's persistent gradient buffers: only in `update`; zeroed before each use |
| prefix_states | prompt prefix K/V and vision encodings made during rollout, consumed in `ref` / `update` |
| critic_weights | the value model (PPO-GAE, rl/critic.py): values scored in `ref`, trained in `update_critic` |
| critic_optimizer | the critic's AdamW moments + masters: only in `update_critic` |
| critic_grads | the critic's persistent gradient buffers: only in `update_critic`; zeroed before each use |

The critic's regions are empty (zero bytes) unless the step trains one (`adv_estimator="gae"`), and a
step without one never enters `update_critic`. The two trainers' updates are phases of their own
because neither reads the other's state: the gradients of the one not training are released for
free, and its optimizer state may be offloaded — two 3B trainers' AdamW states and gradients (about
80 GiB) and a micro-batch's activations do not fit one GPU beside the policy and the reference.

In each phase a region is `resident`, `released` (its physical memory returned, contents dropped:
free to do, nothing to copy back) or `offloaded` (a pinned CPU copy kept, contents restored on
resume). Activations are transient and not a region: the plan budgets them per phase.

The plan is data: fit.py picks the cheapest plan (and trainer settings) that fits a device budget
(releases first, since they cost nothing; then offloads and the trainer's measures by cost),
`table()` prints it, and `with_overrides` applies a user's `tag:phase=residency` list. This module
is torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("rollout", "ref", "update", "update_critic")
TAGS = ("weights", "ref_weights", "kv_cache", "optimizer", "grads", "prefix_states", "critic_weights",
        "critic_optimizer", "critic_grads")
RESIDENCIES = ("resident", "released", "offloaded")

# the phases that read each tag's contents; elsewhere it may be released or offloaded
NEEDED = {
    "weights": set(PHASES),
    "ref_weights": {"ref"},
    "kv_cache": {"rollout"},
    "optimizer": {"update"},
    "grads": {"update"},
    "prefix_states": set(PHASES),
    "critic_weights": {"ref", "update_critic"},
    "critic_optimizer": {"update_critic"},
    "critic_grads": {"update_critic"},
}
# contents that must survive a pause (so only `offloaded` or `resident` keep them)
PRESERVED = {"weights", "ref_weights", "optimizer", "prefix_states", "critic_weights", "critic_optimizer"}
# contents that never change while paused: the CPU copy is taken once, each pause is free
FROZEN = {"ref_weights"}


def _fmt_gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


@dataclass(frozen=True)
class PhasePlan:
    """residency[phase][tag]; tags absent from a phase's dict are resident."""

    residency: dict[str, dict[str, str]] = field(default_factory=lambda: {p: {} for p in PHASES})
    name: str = "custom"

    def __post_init__(self):
        for phase, tags in self.residency.items():
            if phase not in PHASES:
                raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
            for tag, r in tags.items():
                if tag not in TAGS:
                    raise ValueError(f"unknown memory tag {tag!r}; tags are {TAGS}")
                if r not in RESIDENCIES:
                    raise ValueError(f"residency of {tag} in {phase} must be one of {RESIDENCIES}, got {r!r}")
                if r != "resident" and phase in NEEDED[tag]:
                    raise ValueError(f"{tag} is read in the {phase} phase: it must be resident there")
                if r == "released" and tag in PRESERVED:
                    raise ValueError(f"{tag} must keep its contents: use 'offloaded', not 'released', in {phase}")
        for p in PHASES:
            self.residency.setdefault(p, {})

    def get(self, phase: str, tag: str) -> str:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        return self.residency[phase].get(tag, "resident")

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def all_resident(cls) -> PhasePlan:
        return cls({p: {} for p in PHASES}, name="resident")

    @classmethod
    def releases_only(cls) -> PhasePlan:
        """Release what costs nothing to drop: the KV cache outside rollout, each trainer's gradients outside
        its own update."""
        res = {p: {} for p in PHASES}
        for p in PHASES:
            if p != "rollout":
                res[p]["kv_cache"] = "released"
            if p != "update":
                res[p]["grads"] = "released"
            if p != "update_critic":
                res[p]["critic_grads"] = "released"
        return cls(res, name="release")

    def with_residency(self, tag: str, residency: str, phases=None, name: str | None = None) -> PhasePlan:
        res = {p: dict(t) for p, t in self.residency.items()}
        for p in phases or [p for p in PHASES if p not in NEEDED[tag]]:
            res[p][tag] = residency
        return PhasePlan(res, name=name or self.name)

    def with_overrides(self, spec: str | None) -> PhasePlan:
        """spec: comma-separated `tag:phase=residency` (phase `*` = every phase that does not read the tag)."""
        if not spec:
            return self
        plan = self
        for item in spec.split(","):
            item = item.strip()
            try:
                lhs, residency = item.split("=")
                tag, phase = lhs.split(":")
            except ValueError:
                raise ValueError(f"memory plan override {item!r} is not 'tag:phase=residency'") from None
            phases = None if phase == "*" else [phase]
            plan = plan.with_residency(tag, residency, phases, name="custom")
        return plan

    # ---- accounting ---------------------------------------------------------------------------
    def resident_bytes(self, phase: str, sizes: dict[str, int]) -> int:
        return sum(n for tag, n in sizes.items() if self.get(phase, tag) == "resident")

    def peak(self, phase: str, sizes: dict[str, int], activations: dict[str, int]) -> int:
        return self.resident_bytes(phase, sizes) + activations.get(phase, 0)

    def fits(self, sizes: dict[str, int], activations: dict[str, int], budget: int) -> bool:
        return all(self.peak(p, sizes, activations) <= budget for p in PHASES)

    def transitions(self, src: str, dst: str) -> list[tuple[str, str, str]]:
        """(tag, from, to) for every tag whose residency changes going from phase src to phase dst."""
        return [(t, self.get(src, t), self.get(dst, t)) for t in TAGS if self.get(src, t) != self.get(dst, t)]

    def table(self, sizes: dict[str, int] | None = None, activations: dict[str, int] | None = None,
              held: tuple[str, ...] | None = None) -> str:
        """The plan as text, a row per tag and a column per phase. `held`: the tags a step holds (default all);
        the others' rows are left out, and the critic's phase without a critic."""
        sizes = sizes or {}
        tags = TAGS if held is None else tuple(t for t in TAGS if t in held)
        critic = held is None or "critic_weights" in held
        phases = PHASES if critic else tuple(p for p in PHASES if p != "update_critic")
        head = f"memory plan '{self.name}'"
        rows = [f"{'tag':<17}" + ("" if not sizes else f"{'GiB':>7}") + "".join(f"{p:>14}" for p in phases)]
        for tag in tags:
            size = "" if not sizes else f"{_fmt_gib(sizes.get(tag, 0)):>7}"
            rows.append(f"{tag:<17}{size}" + "".join(f"{self.get(p, tag):>14}" for p in phases))
        if sizes:
            acts = activations or {}
            rows.append(f"{'activations':<17}{'':>7}" + "".join(f"{_fmt_gib(acts.get(p, 0)):>14}" for p in phases))
            rows.append(f"{'peak GiB':<17}{'':>7}" + "".join(
                f"{_fmt_gib(self.peak(p, sizes, acts)):>14}" for p in phases))
        return "\n".join([head] + rows)

    def to_dict(self) -> dict:
        return {"name": self.name, "phases": {p: {t: self.get(p, t) for t in TAGS} for p in PHASES}}
