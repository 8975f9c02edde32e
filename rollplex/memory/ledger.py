"""The memory ledger: bytes resident per tag per phase, peak per phase, pause/resume times, host buffers made.

Filled by the manager at each phase transition; read as `memory/*` metrics after a step and as the
per-phase table of `GET /memory`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30


@dataclass
class PhaseRecord:
    resident: dict[str, int] = field(default_factory=dict)  # tag -> bytes resident during the phase
    peak: int = 0  # peak device bytes allocated during the phase (0 when unknown)
    mallocs: int = 0  # device segments the allocator requested during the phase (cudaMalloc calls), this step
    entered: int = 0  # how many times the phase was entered


@dataclass
class Ledger:
    phases: dict[str, PhaseRecord] = field(default_factory=dict)
    pause_s: dict[str, float] = field(default_factory=dict)  # tag -> seconds, since the last take()
    resume_s: dict[str, float] = field(default_factory=dict)
    copy_bytes: int = 0  # bytes copied host<->device by offloads, since the last take()
    # host buffers allocated for offloads (the regions' copies, paged optimizer state), since the last take():
    # page-locked on a GPU, where cudaHostAlloc takes seconds per 10 GiB the first time a buffer is made
    host_alloc_s: float = 0.0
    host_alloc_bytes: int = 0

    def record_phase(self, phase: str, resident: dict[str, int]) -> None:
        rec = self.phases.setdefault(phase, PhaseRecord())
        rec.resident = dict(resident)
        rec.entered += 1

    def record_peak(self, phase: str, peak: int) -> None:
        rec = self.phases.setdefault(phase, PhaseRecord())
        rec.peak = max(rec.peak, peak)

    def record_mallocs(self, phase: str, count: int) -> None:
        rec = self.phases.setdefault(phase, PhaseRecord())
        rec.mallocs += count

    def record_transition(self, kind: str, tag: str, seconds: float, copied: int = 0) -> None:
        d = self.pause_s if kind == "pause" else self.resume_s
        d[tag] = d.get(tag, 0.0) + seconds
        self.copy_bytes += copied

    def record_host_alloc(self, seconds: float, nbytes: int) -> None:
        self.host_alloc_s += seconds
        self.host_alloc_bytes += nbytes

    def transition_s(self) -> float:
        return sum(self.pause_s.values()) + sum(self.resume_s.values())

    def metrics(self) -> dict[str, float]:
        """verl-style `memory/*` metrics: per-phase peaks, resident bytes and device allocations (segments
        the caching allocator asked the device for: many in a step's first pass, none once its pools are
        warm), transition costs."""
        m: dict[str, float] = {}
        for phase, rec in self.phases.items():
            m[f"memory/{phase}/peak_gib"] = rec.peak / GiB
            m[f"memory/{phase}/resident_gib"] = sum(rec.resident.values()) / GiB
            m[f"memory/{phase}/device_mallocs"] = float(rec.mallocs)
        for tag, s in self.pause_s.items():
            m[f"memory/pause_s/{tag}"] = s
        for tag, s in self.resume_s.items():
            m[f"memory/resume_s/{tag}"] = s
        m["memory/transition_s"] = self.transition_s()
        m["memory/offload_copy_gib"] = self.copy_bytes / GiB
        m["memory/host_alloc_s"] = self.host_alloc_s
        m["memory/host_alloc_gib"] = self.host_alloc_bytes / GiB
        return m

    def take_metrics(self) -> dict[str, float]:
        """metrics(), then reset the per-step counters (times, copies, peaks)."""
        m = self.metrics()
        self.pause_s.clear()
        self.resume_s.clear()
        self.copy_bytes = 0
        self.host_alloc_s, self.host_alloc_bytes = 0.0, 0
        for rec in self.phases.values():
            rec.peak = rec.mallocs = 0
        return m

    def to_dict(self) -> dict:
        return {p: {"resident_bytes": dict(r.resident), "peak_bytes": r.peak, "entered": r.entered}
                for p, r in self.phases.items()}

    def table(self, tags) -> str:
        phases = list(self.phases)
        rows = [f"{'GiB':<17}" + "".join(f"{p:>14}" for p in phases)]
        for tag in tags:
            rows.append(f"{tag:<17}" + "".join(f"{self.phases[p].resident.get(tag, 0) / GiB:>14.2f}" for p in phases))
        rows.append(f"{'peak':<17}" + "".join(f"{self.phases[p].peak / GiB:>14.2f}" for p in phases))
        return "\n".join(rows)
