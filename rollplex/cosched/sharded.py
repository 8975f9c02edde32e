"""Prefix work on a sharded model: a rank's prefix jobs run as one sweep, in lockstep with the other ranks.

Under data parallelism the reference is sharded by FSDP2 (and, under a tensor-parallel engine, so is
the old policy): a piece of its prefix work needs whole parameters, gathered from every rank. A
`ShardedPrefix` holds one rank's `PrefixJob`s over such a model and runs them unit-major: unit u
(a vision block, the embedding, a decoder layer — `PrefixJob`'s units) is gathered once and run for
every job before unit u + 1. The units and their order depend only on the model and on whether any
prompt of the batch needs the vision tower, which every rank knows, so every rank issues the same
gathers in the same order, a rank with no prompts included (it gathers and computes nothing).

To the co-scheduler it is a job like any other (`parts`, `run(start, stop)`, `next_unit`): a chunk
issues the gathers of its units (`gather(modules)`: a handle from parallel/lockstep.py, on a process
group of its own, asynchronous) and runs each unit once its gather is in: at once on a GPU (the
side stream waits for the collective, the host does not), and on CPU when a later decode step finds
the gather completed, since a rank must never block in its decode loop on a slower rank. The
co-scheduler completes a sweep at the end of the rollout on every rank (`finish`), so no gather is
left for a later phase, where it would have to be ordered against the step's other collectives.

Exactness: each job runs its own units in its own order on the same parameter bytes FSDP2 gathers;
only the interleaving between jobs changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch.nn as nn

from ..models import Qwen25VL
from .prefix import PrefixJob


class ShardedPrefix:
    lockstep = True  # the co-scheduler completes it on every rank at the end of the rollout

    def __init__(self, model: Qwen25VL, jobs: Sequence[PrefixJob], key: str, vision: bool,
                 gather: Callable[[list[nn.Module]], object]):
        """vision: whether the sweep runs the vision tower (any rank's prompt needs it: the same answer on
        every rank); gather(modules): a handle of those modules' whole parameters (`lockstep.Gathered`)."""
        self.model, self.jobs, self.key, self._gather = model, list(jobs), key, gather
        for job in self.jobs:
            if job.vision_units and not vision:
                raise ValueError(f"prefix job {job.key} runs the vision tower but the sweep {key} does not")
            job.owner = self
        self.num_layers = model.cfg.text.num_hidden_layers
        self.vision_units = len(model.visual.blocks) if vision else 0
        self.units = self.vision_units + 1 + self.num_layers
        self.issued = 0  # units whose gather was issued, in order (the co-scheduler's cursor)
        self.computed = 0  # units run for every job
        self._pending: deque = deque()  # (unit, gather handle), issued, not yet run

    @property
    def members(self) -> list[PrefixJob]:
        """The jobs whose prompts the co-scheduler fills with the engine's vision encodings."""
        return self.jobs

    @property
    def next_unit(self) -> int:
        return self.issued

    @property
    def done(self) -> bool:
        return self.computed == self.units

    def parts(self) -> list[tuple[str, int, float]]:
        """(part, units, FLOPs per unit): the jobs' sums, plus one per parameter element of the unit (the
        gather's stand-in, so that a rank with no prompts still has a cost to admit)."""
        per: dict[str, float] = {}
        for job in self.jobs:
            for part, _, f in job.parts():
                per[part] = per.get(part, 0.0) + f
        m = self.model
        numel = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        out = []
        if self.vision_units:
            out.append(("vision", self.vision_units, per.get("vision", 0.0) + numel(m.visual.blocks[0])))
        out.append(("embed", 1, per.get("embed", 0.0) + numel(m.model.embed_tokens)))
        out.append(("layers", self.num_layers, per.get("layers", 0.0) + numel(m.model.layers[0])))
        return out

    def part_units(self, part: str, start: int, stop: int) -> tuple[int, int]:
        base = {"vision": 0, "embed": self.vision_units, "layers": self.vision_units + 1}[part]
        return base + start, base + stop

    def left_flops(self) -> float:
        return sum(job.left_flops() for job in self.jobs)

    def modules(self, u: int) -> list[nn.Module]:
        """What unit u reads: a vision block (the first with the patch embedding, the last with the
        merger), the token embeddings, a decoder layer (the last with the final norm)."""
        m, V = self.model, self.vision_units
        if u < V:
            return ([m.visual.patch_embed] if u == 0 else []) + [m.visual.blocks[u]] + (
                [m.visual.merger] if u == V - 1 else [])
        if u == V:
            return [m.model.embed_tokens]
        i = u - V - 1
        return [m.model.layers[i]] + ([m.model.norm] if i == self.num_layers - 1 else [])

    def run(self, start: int, stop: int) -> None:
        """Issue the gathers of units [start, stop) (start: the next unit to issue), each unit run as soon
        as its gather is in (on a GPU at once, so one unit's whole parameters are freed for the next's
        before it is gathered)."""
        if start != self.issued or not start <= stop <= self.units:
            raise ValueError(f"sweep {self.key}: units [{start}, {stop}) but the next unit is {self.issued}")
        for u in range(start, stop):
            self._pending.append((u, self._gather(self.modules(u))))
            self.issued = u + 1
            while self._pending and self._pending[0][1].ready():
                self._run_first()

    def complete(self) -> None:
        """Issue every unit left and run them all, waiting for the other ranks' shards: one gather ahead
        of the unit that runs, so at most two units are whole at once."""
        while self.issued < self.units:
            self._pending.append((self.issued, self._gather(self.modules(self.issued))))
            self.issued += 1
            while len(self._pending) > 1:
                self._run_first()
        while self._pending:
            self._run_first()

    def _run_first(self) -> None:
        u, g = self._pending[0]
        with g.swapped():
            for job in self.jobs:
                ju = self._job_unit(job, u)
                if ju is not None and job.next_unit == ju:  # (a unit that ran before an OOM stays done)
                    job.run(ju, ju + 1)
        g.release()
        self._pending.popleft()
        self.computed = u + 1

    def _job_unit(self, job: PrefixJob, u: int) -> int | None:
        """The job's own unit for the sweep's unit u (None: a vision unit of a job without images)."""
        if u < self.vision_units:
            return u if job.vision_units else None
        return u - self.vision_units + job.vision_units

    def tensors(self) -> list:
        return [t for job in self.jobs for t in job.tensors()]
