"""Micro-batches: what one forward (or forward + backward) holds, planned the same way for scoring
and for the actor update.

    rollplex: a few prompts with all their samples, so each prompt's prefix runs once per pass
    serial:   a few full sequences (prompt + response each)

by count (`prompts` / `samples`) or, with `max_tokens`, as many as fit a token budget (verl's
use_dynamic_bsz + ppo_max_token_len_per_gpu). Tokens are what the pass computes: rollplex counts each
prompt once plus its responses (padded to R on the prefix-state path), serial counts the prompt per
sequence. `packed` picks how a rollplex micro-batch runs: all prompts and responses packed into one
sequence, or a prefix pass then the padded responses over its PrefixState; and how a serial one runs:
its full sequences packed without padding (verl's use_remove_padding), or right-padded to the longest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .batch import RolloutBatch


@dataclass(frozen=True)
class MicroBatching:
    prompts: int  # rollplex: prompts per pass (all their samples together)
    samples: int  # serial: sequences per pass
    max_tokens: int | None  # token budget per pass; replaces the two counts when set
    packed: bool  # rollplex: one packed pass (True) or prefix pass + padded responses (False)

    def __post_init__(self):
        if self.prompts < 1 or self.samples < 1:
            raise ValueError("micro-batches need at least one prompt / sample")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1 (or None)")


def plan_micro_batches(costs: list[int], per_mb: int, max_tokens: int | None = None) -> list[list[int]]:
    """Split items 0..len(costs)-1, in order, into runs: `per_mb` items each, or (max_tokens set) as
    many as fit max_tokens by their costs, at least one per run."""
    runs: list[list[int]] = []
    total = 0
    for i, c in enumerate(costs):
        if not runs or (len(runs[-1]) >= per_mb if max_tokens is None else total + c > max_tokens):
            runs.append([])
            total = 0
        runs[-1].append(i)
        total += c
    return runs


def micro_batches(batch: RolloutBatch, mode: str, plan: MicroBatching) -> Iterator[tuple[RolloutBatch, torch.Tensor]]:
    """Yield (micro-batch, sample indices into `batch`)."""
    lens = batch.response_lengths() if plan.max_tokens is not None else [0] * batch.num_samples
    P = [len(p.input_ids) for p in batch.prompts]
    if mode == "rollplex":
        costs = list(P)  # each prompt once, plus its responses (padded to R on the prefix-state path)
        for i, g in enumerate(batch.group.tolist()):
            costs[g] += lens[i] if plan.packed else batch.responses.shape[1]
        for ids in plan_micro_batches(costs, plan.prompts, plan.max_tokens):
            yield batch.select_prompts(ids)
    else:
        costs = [P[g] + n for g, n in zip(batch.group.tolist(), lens)]
        for ids in plan_micro_batches(costs, plan.samples, plan.max_tokens):
            idx = torch.tensor(ids, dtype=torch.long)
            yield batch.select_samples(idx), idx


def halve(plan: MicroBatching, mode: str) -> MicroBatching | None:
    """The next smaller micro-batching, or None at one prompt (rollplex) / one sequence (serial) per pass."""
    if plan.max_tokens is not None:
        if plan.max_tokens <= 1:
            return None
        return MicroBatching(plan.prompts, plan.samples, plan.max_tokens // 2, plan.packed)
    if mode == "rollplex":
        return None if plan.prompts <= 1 else MicroBatching(plan.prompts // 2, plan.samples, None, plan.packed)
    return None if plan.samples <= 1 else MicroBatching(plan.prompts, plan.samples // 2, None, plan.packed)


def capped(plan: MicroBatching, cap: MicroBatching | None) -> MicroBatching:
    """`plan` no larger than `cap` (a micro-batching an out-of-memory back-off settled on)."""
    if cap is None:
        return plan
    return MicroBatching(min(plan.prompts, cap.prompts), min(plan.samples, cap.samples),
                         cap.max_tokens if plan.max_tokens is None else min(plan.max_tokens, cap.max_tokens or 1 << 62),
                         plan.packed)


class Backoff:
    """The micro-batching an out-of-memory back-off halved to, kept for the rest of the run: it caps later
    plans (`plan`)."""

    def __init__(self):
        self.cap: MicroBatching | None = None

    def plan(self, plan: MicroBatching) -> MicroBatching:
        return capped(plan, self.cap)
