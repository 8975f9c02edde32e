"""ReMax's greedy baseline (adv_estimator="remax", verl's compute_remax_outcome_advantage).

verl rolls out one extra greedy response per prompt in a second generate call and uses its reward as the
baseline of the prompt's sampled responses. Rollplex asks for it in the same rollout call: each prompt's
request holds its n samples and one greedy continuation (`SamplingParams.n_greedy`), which forks the
prompt's KV like the samples — one prefill per prompt, no second pass over the engine's weights. The
batch carries the greedy responses apart from the samples (`RolloutBatch.greedy`, never trained on); the
step's reward function scores them beside the samples (`score_baselines`), and each sample's
`RolloutBatch.baselines` entry is the reward of its prompt's greedy response. The advantage is then
`algos.remax_advantages`: the undiscounted reward-to-go of each token minus that baseline.

The rollout is the same in `serial` and `rollplex` mode (only scoring and training differ), and a chunk of
the fused schedule carries its prompts' greedy responses, so all three score the same baselines. Dynamic
sampling keeps a kept group's baseline with it. Over HTTP the server rolls out the greedy responses with a
ReMax /rollout and returns them as `greedy` (one per prompt); /train_step scores them with its reward
function, or takes a client's `greedy_rewards` beside `rewards`.
"""

from __future__ import annotations

import torch

REMAX = "remax"


def greedy_samples(cfg) -> int:
    """Greedy continuations per prompt a rollout of `cfg` (an RLConfig) asks for: 1 for ReMax, else 0."""
    return 1 if cfg.adv_estimator == REMAX else 0


def set_baselines(batch, greedy_rewards: torch.Tensor) -> None:
    """Each sample's baseline [N]: the reward of its prompt's greedy response (`greedy_rewards` [B])."""
    greedy_rewards = torch.as_tensor(greedy_rewards, dtype=torch.float32)
    if greedy_rewards.shape != (batch.num_prompts,):
        raise ValueError(f"ReMax needs one greedy reward per prompt: got {tuple(greedy_rewards.shape)} for "
                         f"{batch.num_prompts} prompts")
    if not bool(torch.isfinite(greedy_rewards).all()):
        raise ValueError("ReMax's greedy rewards must be finite")
    batch.baselines = greedy_rewards[batch.group]


def score_baselines(rewards, batch, prompt_ids: list[int]) -> None:
    """Score the batch's greedy responses with `rewards(batch, prompt_ids) -> (scores [B], metrics)` (the
    step's reward over a batch of whole groups) and set the samples' baselines; nothing without them."""
    if batch.greedy is None:
        return
    scores, _ = rewards(batch.greedy, prompt_ids)
    set_baselines(batch, scores)
