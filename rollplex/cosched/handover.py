"""The hand-over of prefix work from the rollout to scoring: the co-scheduler's side of an RL step.

The step plans the prefixes it will score after the rollout as `PrefixRows` by consumer ("ref", "old");
here they run beside the rollout's decode steps (`co_scheduled`: the co-scheduler hooked into the
engine), and scoring reads them from `RolloutBatch.prefix`. Jobs never admitted beside decode run
standalone in their normal phase (`complete`), and their time calibrates the co-scheduler's cost
estimates. A consumer that needs some prompts' rows while the rollout still runs (the fused schedule's
worker) takes the jobs over (`claim`): under the co-scheduler's lock their pending units leave its queue,
the caller's stream waits for their chunks in flight, and the caller runs the rest. No unit runs twice or
on two streams at once, and the values are the same whoever runs a unit.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch

from .rows import PrefixRows
from .scheduler import CoScheduler


@contextmanager
def co_scheduled(cosched: CoScheduler | None, engine, handover: dict[str, PrefixRows], prefilled, timeline=None,
                 priority: bool = True):
    """The rollout in the body with the handover's jobs beside `engine`'s decode (with `priority`, decode on
    a high-priority stream; without, the body enters it). Yields a dict that holds the co-scheduler's
    metrics once the body is done (none without jobs). prefilled: the prompts whose vision encodings the
    engine's prefill provides."""
    metrics: dict = {}
    jobs = [(job, i) for i, job in enumerate(j for rows in handover.values() for j in rows.jobs)]
    if not jobs:
        yield metrics
        return
    cosched.begin(jobs, timeline, prefilled=prefilled)
    engine.hooks.append(cosched)
    try:
        with cosched.decode_priority() if priority else nullcontext():
            yield metrics
    finally:
        engine.hooks.remove(cosched)
        metrics.update(cosched.finish())


def complete(cosched: CoScheduler, rows: PrefixRows, device: torch.device) -> float:
    """Run the rows' jobs that were never admitted beside decode, standalone (their normal phase); their
    time calibrates the co-scheduler's cost estimates. Returns the seconds it took."""
    left = [j for j in rows.jobs if not j.done]
    flops = sum(j.left_flops() for j in left)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for j in left:
            j.complete()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dt = time.perf_counter() - t0
    if left:
        cosched.calibrate(flops, dt)
    return dt


def claim(cosched: CoScheduler, handover: dict[str, PrefixRows], prompt_ids: list[int], device: torch.device,
          cancelled=None) -> dict[str, PrefixRows]:
    """The handover's rows of prompts `prompt_ids` (a chunk's `RolloutBatch.prefix`), every job covering them
    done, on the caller's thread and current stream. Jobs the co-scheduler has not finished are claimed from
    it (`CoScheduler.claim`: it never runs their units again), the current stream waits for their chunks in
    flight, and the rest of their units runs here. cancelled: see `CoScheduler.claim`."""
    if not handover:
        return {}
    rows = {k: r.select(prompt_ids) for k, r in handover.items()}
    jobs = list({id(j): j for r in rows.values() for j in r.jobs}.values())
    events = cosched.claim(jobs, cancelled)
    if device.type == "cuda":
        cur = torch.cuda.current_stream(device)
        for ev in events:
            cur.wait_event(ev)
        # made on the co-scheduler's stream (or the prefill's), read and freed on this one: the allocator
        # must not hand their blocks to the co-scheduler's next chunk before this stream is done with them
        for j in jobs:
            for t in j.tensors():
                t.record_stream(cur)
    with torch.no_grad():
        for j in jobs:
            j.complete()
    return rows
