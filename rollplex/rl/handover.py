"""Prefix work handed over from the rollout to scoring: the co-scheduler's side of the RL step.

With `cfg.cosched` (the native engine) the prefixes the step will score after the rollout — the
reference's, and the old policy's when several updates need old logprobs — are planned as jobs
(`plan_handover`), run beside the rollout's decode steps by the co-scheduler hooked into the engine
(`co_scheduled`), and handed to scoring in `RolloutBatch.prefix`. Jobs never admitted beside decode
run standalone in their normal phase (`complete_handover`), and their time calibrates the
co-scheduler's cost estimates. Without cosched nothing is planned and the rollout runs as is.

The co-scheduler is one producer of the step's pipeline of groups: under the fused schedule
(rl/schedule.py `Fused`) the same jobs are planned and run beside decode, and each chunk of finished
groups, scored on the pipeline's worker thread while the rollout goes on, reads its prompts' rows of the
handover (`claim_handover`). A job that chunk needs and the co-scheduler has not finished is taken over:
under the co-scheduler's lock its pending units leave the queue (`CoScheduler.claim`), the worker's stream
waits for its chunks in flight on the co-scheduler's stream, and the worker runs the rest. No unit runs
twice or on two streams at once, and the values are the same whoever runs a unit. Whatever no chunk
claimed while the rollout ran completes in its normal phase, after the rollout, as in the phased step.

Under a data-parallel runtime each rank plans its share of the prompts (those its engine prefilled:
`Runtime.share`): on a model it holds whole alone, on a sharded one as a sweep in lockstep with the
other ranks' (`Runtime.reference_gather`, `Runtime.old_policy`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import torch

from ..cosched import PrefixRows
from .batch import RolloutBatch


def plan_handover(step, prompts: list, frozen: bool, ref_resident: bool = False) -> dict[str, PrefixRows]:
    """Prefix jobs to run beside decode, by consumer: the reference's (when the memory plan keeps its
    weights resident during the rollout, or `ref_resident`: the fused schedule holds them there) and the
    old policy's (several updates per rollout). frozen: the prompts carry the engine's vision encodings
    (`RLStep.keeps_vision`)."""
    cfg, out = step.cfg, {}
    if not cfg.cosched or step.engine is None:
        return out
    per_job = step.cosched.config.job_prompts
    only = step.runtime.share(len(prompts))
    if step.ref is not None and cfg.kl_coef > 0 and (
            ref_resident or step.memory is None or step.memory.plan.get("rollout", "ref_weights") == "resident"):
        # a frozen tower's encodings come from the engine's prefill, unless the reference's tower differs
        shared = frozen and step.ref_same_vision
        ref_prompts = prompts if shared or not frozen else [replace(p, vision_embeds=None) for p in prompts]
        out["ref"] = PrefixRows.plan(step.ref, ref_prompts, per_job, "ref", external_vision=shared, only=only,
                                     gather=step.runtime.reference_gather(step.ref))
    if cfg.num_updates > 1:  # the policy, or the trainer's shards (a tensor-parallel engine holds only its own)
        model, gather = step.runtime.old_policy(step.model, step.actor.model)
        out["old"] = PrefixRows.plan(model, prompts, per_job, "old", external_vision=frozen, only=only, gather=gather)
    return out


@contextmanager
def co_scheduled(step, handover: dict[str, PrefixRows], prefilled, priority: bool = True):
    """The rollout in the body with the handover's jobs beside its decode (with `priority`, decode on a
    high-priority stream; without, the body enters it); afterwards `step.rollout_metrics` holds the
    co-scheduler's metrics (none without jobs). prefilled: the prompts whose vision encodings the engine's
    prefill provides."""
    jobs = [(job, i) for i, job in enumerate(j for rows in handover.values() for j in rows.jobs)]
    if not jobs:
        yield
        step.rollout_metrics = {}
        return
    step.cosched.begin(jobs, step.timeline, prefilled=prefilled)
    step.engine.hooks.append(step.cosched)
    try:
        with step.cosched.decode_priority() if priority else nullcontext():
            yield
    finally:
        step.engine.hooks.remove(step.cosched)
        step.rollout_metrics = step.cosched.finish()


def complete_handover(step, batch: RolloutBatch, key: str, m: dict) -> None:
    """Run the handed-over prefix work under `key` that was never admitted beside decode, standalone (its
    normal phase); its time calibrates the co-scheduler's cost estimates."""
    rows = batch.prefix.get(key)
    if rows is None:
        return
    left = [j for j in rows.jobs if not j.done]
    flops = sum(j.left_flops() for j in left)
    if step.device.type == "cuda":
        torch.cuda.synchronize(step.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for j in left:
            j.complete()
    if step.device.type == "cuda":
        torch.cuda.synchronize(step.device)
    dt = time.perf_counter() - t0
    if left:
        step.cosched.calibrate(flops, dt)
    m[f"rollplex/prefix_{key}_normal_phase_s"] = dt


def claim_handover(step, handover: dict[str, PrefixRows], prompt_ids: list[int], cancelled=None) -> dict:
    """The handover's rows of prompts `prompt_ids` (a chunk's `RolloutBatch.prefix`), every job covering them
    done: the fused pipeline's consumer side, on the caller's thread and current stream. Jobs the
    co-scheduler has not finished are claimed from it (`CoScheduler.claim`: it never runs their units
    again), the current stream waits for their chunks in flight, and the rest of their units runs here.
    cancelled: see `CoScheduler.claim`."""
    if not handover:
        return {}
    rows = {k: r.select(prompt_ids) for k, r in handover.items()}
    jobs = list({id(j): j for r in rows.values() for j in r.jobs}.values())
    events = step.cosched.claim(jobs, cancelled)
    if step.device.type == "cuda":
        cur = torch.cuda.current_stream(step.device)
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
