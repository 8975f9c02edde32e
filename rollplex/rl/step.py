"""One synchronous GRPO/PPO step: rollout -> rewards -> reference logprobs -> (old logprobs) -> update.

`mode` changes where the work runs, never what is computed:

* `rollplex`: reference scoring and training run each prompt's prefix (vision tower + prompt) once
  and let its n responses attend to it; the backward flows through the one shared prefix graph.
* `serial`: verl's order and shapes — each sample is a full sequence with its image re-encoded.

The engine decodes with the actor's own parameter tensors, so there is no weight-sync phase; the
reference model is a frozen copy of the initial policy. `train(batch, cfg)` takes an optional
config for that step alone (the server's per-request overrides), derived from `self.cfg` with
`dataclasses.replace`; `self.cfg` never changes.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager

import torch

from ..engine import Engine, SamplingParams
from ..models import Qwen25VL
from .actor import Actor
from .algos import grpo_advantages, kl_penalty
from .batch import RolloutBatch
from .config import RLConfig
from .rewards import RewardFn, get_reward_fn, score_samples
from .scoring import score as score_logprobs


@contextmanager
def _timer(metrics: dict, name: str, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t0


class RLStep:
    def __init__(self, model: Qwen25VL, engine: Engine | None, cfg: RLConfig, processor=None,
                 reward_fn: RewardFn | str | None = None, ref_model: Qwen25VL | None = None):
        if engine is not None and engine.model is not model:
            raise ValueError("the engine must decode with the actor's own model (shared weights)")
        self.model, self.engine, self.cfg = model, engine, cfg
        self.processor = processor or (engine.processor if engine is not None else None)
        self.reward_fn = reward_fn if callable(reward_fn) else get_reward_fn(reward_fn)
        self.ref = ref_model
        if self.ref is None and cfg.kl_coef > 0:
            self.ref = copy.deepcopy(model)
        if self.ref is not None:
            self.ref.requires_grad_(False).eval()
        self.actor = Actor(model, cfg)
        self.step_idx = 0
        self.device = model.inv_freq.device

    # ---- phases -------------------------------------------------------------------------------
    def rollout(self, rows: list[dict]) -> RolloutBatch:
        from ..data import ground_truth, row_to_inputs

        cfg = self.cfg
        if self.engine is None:
            raise ValueError("this RLStep has no engine: pass rollouts to train() instead")
        prompts = [row_to_inputs(self.processor, r) for r in rows]
        params = [SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p,
                                 max_new_tokens=cfg.max_new_tokens,
                                 seed=(cfg.seed * 1_000_003 + self.step_idx * 10_007 + i * 101) % 2**62)
                  for i in range(len(rows))]
        outs = self.engine.generate(prompts, params)
        return RolloutBatch.from_outputs(
            prompts, outs, pad_id=self.model.cfg.pad_token_id or 0,
            data_sources=[r.get("data_source") for r in rows], ground_truths=[ground_truth(r) for r in rows],
            extra_infos=[r.get("extra_info") for r in rows])

    def compute_rewards(self, batch: RolloutBatch, reward: RewardFn | str | None = None) -> tuple[torch.Tensor, dict]:
        """Rewards [N] of a rollout's samples and their extra metrics, by `reward` (a function, a
        registered name or module:function) or this step's reward function. ValueError for an unknown
        reward, a reward function that fails, or a non-finite score."""
        fn = self.reward_fn if reward is None else reward if callable(reward) else get_reward_fn(reward)
        ex = batch.extras
        scores, extra = score_samples(fn, ex["data_sources"], ex["texts"], ex["ground_truths"], ex["extra_infos"],
                                      name=reward if isinstance(reward, str) else None)
        return torch.tensor(scores, dtype=torch.float32), extra

    def train(self, batch: RolloutBatch, cfg: RLConfig | None = None) -> dict:
        """Reference scoring, advantages and the actor update for a batch with rewards; `cfg`: this
        step's config (default: `self.cfg`)."""
        cfg, m = cfg or self.cfg, {}
        if batch.rewards is None:
            raise ValueError("the batch has no rewards")
        ref_lp = None
        if self.ref is not None and cfg.kl_coef > 0:
            with _timer(m, "ref", self.device):
                ref_lp = score_logprobs(self.ref, batch, cfg.mode, cfg.micro_batching, cfg.temperature)
        rewards = batch.rewards.float()
        if ref_lp is not None and not cfg.use_kl_loss:  # KL as a reward penalty (policy = rollout logprobs)
            kl = (kl_penalty(batch.rollout_logprobs, ref_lp, cfg.kl_loss_type) * batch.mask).sum(-1)
            rewards = rewards - cfg.kl_coef * kl
            m["critic/kl_penalty"] = float(kl.mean())
        adv = grpo_advantages(rewards, batch.group, cfg.norm_adv_by_std)
        with _timer(m, "old_log_prob", self.device):
            old = self.actor.old_logprobs(batch, cfg)
        with _timer(m, "update_actor", self.device):
            stats, first_lp = self.actor.update(batch, adv, ref_lp if cfg.use_kl_loss else None, old, self.step_idx,
                                                cfg)
        m.update(stats)
        train_lp = old if old is not None else first_lp
        if batch.rollout_logprobs is not None:
            sel = batch.mask > 0
            diff = (batch.rollout_logprobs.exp() - train_lp.exp()).abs()[sel]
            m["training/rollout_probs_diff_mean"] = float(diff.mean())
            m["training/rollout_probs_diff_max"] = float(diff.max())
        lens = batch.mask.sum(-1)
        m.update({
            "critic/score/mean": float(batch.rewards.mean()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv.mean()),
            "critic/advantages/max": float(adv.max()),
            "response_length/mean": float(lens.mean()),
            "response_length/max": float(lens.max()),
            "rollplex/prefix_dedup_ratio": batch.num_samples / batch.num_prompts if cfg.mode == "rollplex" else 1.0,
        })
        self.step_idx += 1
        return m

    def step(self, rows: list[dict]) -> dict:
        """The full step on a batch of dataset rows; returns verl-named metrics."""
        m: dict = {}
        t0 = time.perf_counter()
        with _timer(m, "gen", self.device):
            batch = self.rollout(rows)
        with _timer(m, "reward", self.device):
            batch.rewards, extra = self.compute_rewards(batch)
        m.update(extra)
        m.update(self.train(batch))
        m["timing_s/step"] = time.perf_counter() - t0
        tokens = sum(len(batch.prompts[g].input_ids) for g in batch.group.tolist()) + float(batch.mask.sum())
        m["perf/throughput"] = tokens / m["timing_s/step"]
        m["training/global_step"] = self.step_idx
        return m
