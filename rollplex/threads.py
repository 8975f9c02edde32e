"""How many CPU threads a CPU run of the demo or the driver uses, and why: picked once, said once.

    n, why = pick_threads(requested, device, tiny)
    torch.set_num_threads(n)

Order: `--threads N` when given, else `$OMP_NUM_THREADS` when set, else for the embedded tiny model on the
CPU one thread, else torch's default (one per core). On an idle 2-core machine a second thread makes the
tiny model's step about 1.4× faster, but on a machine whose cores other jobs use each step waits for the
busiest core — with torch's default 2 threads on a shared 2-core machine the demo ran 3–7× slower than with
1 (docs/BENCHMARKS.md, "CPU benches"): one thread is the pick that never thrashes. The thread count also changes
the order of fp32 sums and so the run's trajectory: the steps a seed needs hold at one thread count only,
which is why every recorded number says its count. On a GPU the host threads do little; torch's default
is kept.
"""

from __future__ import annotations

import os

import torch

TINY_THREADS = 1


def pick_threads(requested: int | None, device: str, tiny: bool) -> tuple[int, str]:
    """(threads, the reason in words) for a run on `device`; `tiny`: the embedded tiny model.
    ValueError for a requested count below 1."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) >= 1:
        return int(env), "$OMP_NUM_THREADS"
    if device == "cpu" and tiny:
        return TINY_THREADS, "the tiny model's default on the CPU; OMP_NUM_THREADS=N or --threads N for more"
    return torch.get_num_threads(), "torch's default"


def apply_threads(requested: int | None, device: str, tiny: bool) -> str:
    """Set torch's intra-op threads as `pick_threads` says; the line that says so."""
    n, why = pick_threads(requested, device, tiny)
    torch.set_num_threads(n)
    return f"CPU threads: {n} ({why})"
