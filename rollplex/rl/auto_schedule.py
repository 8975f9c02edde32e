"""`schedule="auto"`: which schedule a step runs, chosen from what earlier steps measured. Torch-free.

Fused and phased compute the same update (up to summation order, rl/schedule.py), so the choice is
only about time. `AutoChooser` keeps, per arm ("phased", "fused"), an EMA of the seconds a step took
per token it processed (steps differ in their rollouts' lengths; per token they compare), and:

    explore   each arm runs `warmup` steps whose time is dropped (compiles, first allocations, the
              side stream's green context), then one measured step; phased first
    exploit   the arm with the lower EMA; fused must beat phased by `margin` (a tie runs phased,
              which has no side work), and a fused step whose gate trained no group beside decode
              (`fused_groups_in_rollout` = 0: every group finished with the rollout) counts as not
              paying whatever its time
    re-probe  the other arm once every `reprobe_steps` steps, so a workload that changes (longer
              tails, a bigger batch) is seen; a probe costs at most (its slowdown) / reprobe_steps
    drop      an arm that cannot run (`unavailable`: the fused schedule unsupported by the step's
              config, backend or memory) is never picked again

`pick()` names the arm of the next step; `record(arm, seconds, tokens, fused_groups)` reports it;
`metrics()` gives `rollplex/auto_*` (the arm run, each arm's seconds per 1k tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARMS = ("phased", "fused")


@dataclass
class _Arm:
    runs: int = 0  # steps run, warm-up ones included
    ema: float | None = None  # seconds per token (measured steps only)
    last: int = -1  # the step index it last ran at
    pays: bool = True  # fused: its last measured step trained some group beside decode


@dataclass
class AutoChooser:
    reprobe_steps: int = 16
    margin: float = 0.01
    warmup: int = 1
    ema: float = 0.5
    arms: dict[str, _Arm] = field(default_factory=lambda: {a: _Arm() for a in ARMS})
    steps: int = 0
    last_pick: str | None = None

    def __post_init__(self):
        if self.reprobe_steps < 2 or not 0.0 <= self.margin < 1.0 or self.warmup < 0 or not 0.0 < self.ema <= 1.0:
            raise ValueError("auto schedule: reprobe_steps >= 2, margin in [0, 1), warmup >= 0, ema in (0, 1]")

    def unavailable(self, arm: str) -> None:
        """`arm` cannot run on this step (and is not tried again)."""
        self.arms.pop(arm, None)

    def pick(self) -> str:
        live = [a for a in ARMS if a in self.arms]
        assert live, "phased is always available"
        for a in live:  # explore: warm-up runs, then one measured run, phased first
            if self.arms[a].ema is None:
                return self._chose(a)
        best = self.best()
        for a in live:  # re-probe the other arm: once in every reprobe_steps steps
            if a != best and self.steps - self.arms[a].last >= self.reprobe_steps - 1:
                return self._chose(a)
        return self._chose(best)

    def best(self) -> str:
        """The arm to exploit: the faster per token, fused only by `margin` and when it paid."""
        if "fused" not in self.arms:
            return "phased"
        f, p = self.arms["fused"], self.arms["phased"]
        if f.ema is None or p.ema is None or not f.pays:
            return "phased"
        return "fused" if f.ema < p.ema * (1.0 - self.margin) else "phased"

    def _chose(self, arm: str) -> str:
        self.last_pick = arm
        return arm

    def record(self, arm: str, seconds: float, tokens: float, fused_groups: float | None = None) -> None:
        """A step of `arm` took `seconds` for `tokens` tokens; fused_groups: the groups it trained beside
        decode (fused steps)."""
        st = self.arms.get(arm)
        self.steps += 1
        if st is None:  # an arm dropped while its step ran (it fell back): nothing to learn
            return
        st.runs += 1
        st.last = self.steps
        if arm == "fused" and fused_groups is not None:
            st.pays = fused_groups > 0
        if st.runs <= self.warmup or tokens <= 0 or seconds <= 0:
            return
        rate = seconds / tokens
        st.ema = rate if st.ema is None else st.ema + self.ema * (rate - st.ema)

    def metrics(self) -> dict:
        m = {"rollplex/auto_fused": float(self.last_pick == "fused")}
        for a, st in self.arms.items():
            if st.ema is not None:
                m[f"rollplex/auto_{a}_s_per_1k_tokens"] = st.ema * 1e3
        return m
