"""DAPO's dynamic sampling (verl's algorithm.filter_groups): the rollout and reward phases of
`RLStep.step` under `cfg.filter_groups`.

A step given B rows rolls them out and scores them, then drops every group whose samples all have
the same `cfg.filter_groups_metric` (seq_reward: the reward trained on, after overlong shaping;
score: the reward function's score before it; any other name: that key of the dict the reward function
returns, e.g. `acc`, as verl's DAPO recipes filter). A group of one sample is kept, as in verl; "the same"
is exact equality (verl's std > 0 up to rounding). While fewer than B groups are kept it rolls out
the rows `more_rows()` returns (the next rows of the driver's data, as verl takes the next batch of
its data loader), at most `cfg.max_num_gen_batches` rollouts in all (0: unbounded). Then the kept
groups, in the order they were rolled out, are trimmed to the first B. Short of B at the bound (or
without `more_rows`) it raises ValueError, as verl does, before anything is trained; with
`cfg.filter_groups_partial` the step trains on the groups it kept instead (ValueError when none).

Seeds: the first rollout is the one the step makes without dynamic sampling (rl.rollout.rollout_requests);
the k-th adds k * SEED_STRIDE to each prompt's seed, so a row drawn again within the step is sampled
afresh rather than repeating the samples it was dropped for.

Metrics: `train/num_gen_batches` (verl's: the rollouts this step made), `train/num_groups_kept` and
`train/num_groups_dropped` (over those rollouts, before the trim); timing_s/gen and timing_s/reward
add up every rollout, `critic/score/<key>` averages every sample scored (dropped groups included).
The co-scheduling metrics are the first rollout's. With `cosched`, the prefix states handed over by a
step that needed a single rollout are kept for its kept groups; one of several rollouts drops them
and scoring runs the prefixes itself (same values). Under a process group every rank must get the
same rows from `more_rows`; rewards and filtering are then the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from .batch import RolloutBatch
from .remax import set_baselines
from .rewards import REWARD_EXTRA_INFO, score_batch
from .rollout import rollout_requests
from .timing import phase_timer as _timer

SEED_STRIDE = 1_000_000_007  # the k-th rollout of a step: each prompt's seed + k * SEED_STRIDE


def kept_groups(values: torch.Tensor, group: torch.Tensor, num_prompts: int) -> list[int]:
    """The prompts whose samples' `values` [N] are not all equal, or that have a single sample."""
    kept = []
    for g in range(num_prompts):
        v = values[group == g]
        if v.numel() == 1 or (v.numel() > 1 and bool((v != v[0]).any())):
            kept.append(g)
    return kept


def metric_values(metric: str, batch: RolloutBatch, scores: list[float] | None) -> torch.Tensor:
    """[N] the values dynamic sampling compares within a group (verl's filter_groups.metric): seq_reward, the
    reward trained on (`batch.rewards`); score, the reward function's score (`scores`); any other name, that
    key of what the reward function returned per sample (`acc`, ...: the batch's reward_extra_info).
    ValueError when the batch has no such value for every sample."""
    if metric == "seq_reward":
        return batch.rewards
    if metric == "score":
        if scores is None:
            raise ValueError("filter_groups_metric='score' needs the reward function's scores")
        return torch.tensor(scores, dtype=torch.float64)
    infos = batch.extras.get(REWARD_EXTRA_INFO)
    if infos is None or len(infos) != batch.num_samples or any(metric not in d for d in infos):
        known = sorted(set().union(*infos)) if infos else []
        raise ValueError(f"filter_groups_metric={metric!r} is neither seq_reward, score nor a key the reward "
                         f"function returned for every sample (it returned {known or 'only a score'})")
    return torch.tensor([d[metric] for d in infos], dtype=torch.float64)


def _rollout(rl, rows: list[dict], k: int) -> RolloutBatch:
    """The step's k-th rollout of `rows` (module docstring: seeds)."""
    if k == 0:
        return rl.rollout(rows)
    prompts, params, per_prompt = rollout_requests(rl.processor, rows, rl.cfg, rl.step_idx)
    params = [p if p.seed is None else replace(p, seed=(p.seed + k * SEED_STRIDE) % 2**62) for p in params]
    return rl.generate(prompts, params, **per_prompt)


def sample_groups(rl, rows: list[dict], more_rows: Callable[[], list[dict]] | None, m: dict) -> RolloutBatch:
    """The batch `RLStep.step` trains under `filter_groups` (`rl`: that step): len(rows) groups with
    rewards, rolled out and filtered as the module docstring says; its metrics go into `m`."""
    cfg, target = rl.cfg, len(rows)
    if target < 1:
        raise ValueError("a step needs at least one row")
    kept_batches: list[RolloutBatch] = []
    num_kept = num_dropped = tries = 0
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    while True:
        if tries:
            rows = list(more_rows())
            if not rows:
                raise ValueError("more_rows() returned no rows")
        with _timer(m, "gen", rl.device, rl.timeline):
            batch = _rollout(rl, rows, tries)
        if not tries:
            m.update(rl.rollout_metrics)
        with _timer(m, "reward", rl.device):
            scores, batch.rewards, extra = score_batch(rl.reward_fn, batch, cfg.max_new_tokens, cfg.overlong_buffer_len,
                                                       cfg.overlong_penalty_factor)
        if batch.greedy is not None:  # ReMax: the greedy responses' rewards, the kept groups' baselines
            _, greedy_rewards, _ = score_batch(rl.reward_fn, batch.greedy, cfg.max_new_tokens, cfg.overlong_buffer_len,
                                               cfg.overlong_penalty_factor)
            set_baselines(batch, greedy_rewards)
        tries += 1
        for k, v in extra.items():  # averaged over every sample scored
            sums[k] = sums.get(k, 0.0) + v * batch.num_samples
            counts[k] = counts.get(k, 0) + batch.num_samples
        values = metric_values(cfg.filter_groups_metric, batch, scores)
        kept = kept_groups(values, batch.group, batch.num_prompts)
        num_kept += len(kept)
        num_dropped += batch.num_prompts - len(kept)
        if len(kept) == batch.num_prompts:
            kept_batches.append(batch)
        elif kept:
            kept_batches.append(batch.select_prompts(kept)[0])
        if num_kept >= target or more_rows is None or 0 < cfg.max_num_gen_batches <= tries:
            break
    m.update({k: sums[k] / counts[k] for k in sums})
    m.update({"train/num_gen_batches": tries, "train/num_groups_kept": num_kept,
              "train/num_groups_dropped": num_dropped})
    if num_kept < target and not (cfg.filter_groups_partial and num_kept):
        why = ("without more rows to roll out (pass more_rows to RLStep.step)" if more_rows is None
               else f"after {tries} rollouts (max_num_gen_batches={cfg.max_num_gen_batches})")
        raise ValueError(f"dynamic sampling kept {num_kept} of the {target} groups the step needs {why}: {num_dropped} "
                         f"groups had the same {cfg.filter_groups_metric} for all their samples. The data may be too "
                         "hard or too easy for the policy; raise max_num_gen_batches (0: unbounded), or set "
                         "filter_groups_partial to train on the groups kept")
    batch = kept_batches[0] if len(kept_batches) == 1 else RolloutBatch.concat(
        kept_batches, pad_id=rl.pad_id)
    return batch.select_prompts(list(range(target)))[0] if batch.num_prompts > target else batch
