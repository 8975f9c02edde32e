"""Prefix work handed over from the rollout to scoring: the co-scheduler's side of the RL step.

With `cfg.cosched` (the native engine) the prefixes the step will score after the rollout — the
reference's, and the old policy's when several updates need old logprobs — are planned as jobs
(`plan_handover`), run beside the rollout's decode steps by the co-scheduler hooked into the engine
(`co_scheduled`), and handed to scoring in `RolloutBatch.prefix`. Jobs never admitted beside decode
run standalone in their normal phase (`complete_handover`), and their time calibrates the
co-scheduler's cost estimates. Without cosched nothing is planned and the rollout runs as is.

Under a data-parallel runtime each rank plans its share of the prompts (those its engine prefilled:
`Runtime.share`): on a model it holds whole alone, on a sharded one as a sweep in lockstep with the
other ranks' (`Runtime.reference_gather`, `Runtime.old_policy`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..cosched import PrefixRows
from .batch import RolloutBatch


def plan_handover(step, prompts: list, frozen: bool) -> dict[str, PrefixRows]:
    """Prefix jobs to run beside decode, by consumer: the reference's (when the memory plan keeps its
    weights resident during the rollout) and the old policy's (several updates per rollout). frozen: the
    prompts carry the engine's vision encodings (`RLStep.keeps_vision`)."""
    cfg, out = step.cfg, {}
    if not cfg.cosched or step.engine is None:
        return out
    per_job = step.cosched.config.job_prompts
    only = step.runtime.share(len(prompts))
    if step.ref is not None and cfg.kl_coef > 0 and (
            step.memory is None or step.memory.plan.get("rollout", "ref_weights") == "resident"):
        # a frozen tower's encodings come from the engine's prefill, unless the reference's tower differs
        shared = frozen and step._ref_same_vision
        ref_prompts = prompts if shared or not frozen else [replace(p, vision_embeds=None) for p in prompts]
        out["ref"] = PrefixRows.plan(step.ref, ref_prompts, per_job, "ref", external_vision=shared, only=only,
                                     gather=step.runtime.reference_gather(step.ref))
    if cfg.num_updates > 1:  # the policy, or the trainer's shards (a tensor-parallel engine holds only its own)
        model, gather = step.runtime.old_policy(step.model, step.actor.model)
        out["old"] = PrefixRows.plan(model, prompts, per_job, "old", external_vision=frozen, only=only, gather=gather)
    return out


@contextmanager
def co_scheduled(step, handover: dict[str, PrefixRows], prefilled):
    """The rollout in the body with the handover's jobs beside its decode (decode on a high-priority stream);
    afterwards `step.rollout_metrics` holds the co-scheduler's metrics (none without jobs). prefilled: the
    prompts whose vision encodings the engine's prefill provides."""
    jobs = [(job, i) for i, job in enumerate(j for rows in handover.values() for j in rows.jobs)]
    if not jobs:
        yield
        step.rollout_metrics = {}
        return
    step.cosched.begin(jobs, step.timeline, prefilled=prefilled)
    step.engine.hooks.append(step.cosched)
    try:
        with step.cosched.decode_priority():
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
