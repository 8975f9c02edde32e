"""The hand-over of co-scheduled prefix work to scoring: which job holds each prompt's prefix.

`PrefixRows` holds, for every prompt of a rollout, the `PrefixJob` (prefix.py) that computes its prefix
and its row there; on a model sharded over ranks, the jobs run inside one `ShardedPrefix` (sharded.py).
Scoring asks it for the PrefixState of a micro-batch's prompts (`gather`); any unit that was never
run beside decode runs then, in its normal phase (`complete`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models import ModelInputs, Qwen25VL
from ..models.qwen2_5_vl import PrefixState
from .prefix import PrefixJob
from .sharded import ShardedPrefix


class PrefixRows:
    """Per prompt of a rollout, (job, row): which job computes its prefix and where in that job. `sweep`:
    the ShardedPrefix that runs every job of a sharded model (present on a rank with no rows too)."""

    def __init__(self, rows: list[tuple[PrefixJob, int]], sweep=None):
        self.rows, self.sweep = rows, sweep

    @classmethod
    def plan(cls, model: Qwen25VL, prompts: Sequence[ModelInputs], per_job: int, key: str,
             external_vision: bool = False, only: Sequence[int] | None = None, gather=None) -> PrefixRows:
        """Jobs of `per_job` consecutive prompts each (external_vision: see PrefixJob); `only`: the
        prompts (indices) to plan, the others get no row (a data-parallel rank plans its own share).
        gather: for a model sharded over the ranks, the handle factory of a ShardedPrefix that runs
        the jobs in lockstep with the other ranks' (cosched/sharded.py)."""
        if per_job < 1:
            raise ValueError("per_job must be >= 1")
        ids = list(range(len(prompts))) if only is None else list(only)
        rows: list = [None] * len(prompts)
        jobs = []
        for j, a in enumerate(range(0, len(ids), per_job)):
            part = ids[a : a + per_job]
            jobs.append(PrefixJob(model, [prompts[i] for i in part], f"{key}/{j}", external_vision))
            for r, i in enumerate(part):
                rows[i] = (jobs[-1], r)
        if gather is None:
            return cls(rows)
        # whether the tower runs: decided from every prompt, so every rank's sweep has the same units
        vision = not external_vision and any(p.vision_embeds is None and p.has_vision for p in prompts)
        return cls(rows, ShardedPrefix(model, jobs, f"{key}/sweep", vision, gather))

    @property
    def jobs(self) -> list:
        """The jobs a co-scheduler runs: the PrefixJobs, or the sweep that runs them."""
        if self.sweep is not None:
            return [self.sweep]
        seen: dict[int, PrefixJob] = {}
        for row in self.rows:
            if row is not None:
                seen.setdefault(id(row[0]), row[0])
        return list(seen.values())

    def planned(self) -> list[int]:
        """The prompts (indices) with a row here."""
        return [i for i, row in enumerate(self.rows) if row is not None]

    def select(self, prompt_ids: Sequence[int]) -> PrefixRows:
        return PrefixRows([self.rows[i] for i in prompt_ids])

    def complete(self) -> None:
        for job in self.jobs:
            job.complete()

    def gather(self) -> PrefixState:
        """The PrefixState of these prompts, in order (running any unit still pending)."""
        if any(row is None for row in self.rows):
            raise ValueError("a prompt without a planned prefix row (another rank's share)")
        return PrefixState.from_rows([(job.complete(), r) for job, r in self.rows])

    def __len__(self) -> int:
        return len(self.rows)
