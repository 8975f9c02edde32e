"""One synchronous GRPO/PPO step: rollout -> rewards -> reference logprobs -> (values, old logprobs) ->
advantages -> update. `RLStep` keeps the algorithm; where its work runs and in what order are given.

    run(prompts, params) / step(rows)   the whole step in `cfg.schedule`'s order (rl/schedule.py: phased,
                                        or fused beside the rollout's tail, rl/pipeline.py)
    generate / sample                   the rollout on the rollout backend (rl/rollout.py), with the
                                        co-scheduler's prefix work beside decode (`cfg.cosched`,
                                        cosched/handover.py)
    train(batch, cfg)                   reference scoring, advantages and the update of a finished rollout
    update(...)                         the tail both schedules end in: actor, critic, step counted

The models are Trainers (rl/trainer.py): the actor (rl/actor.py), the critic under gae (rl/critic.py),
the reference (one with no optimizer), built and placed with the runtime and rollout backend by
rl/parts.py (`build_parts`; `RLStep.from_parts` takes them built, `RLStep(model, engine, cfg, ...)` builds
them). Advantages come from `cfg.adv_estimator` (rl/algos.py); with
`use_kl_loss=False` the KL to the reference is a per-token reward penalty (fixed or verl's adaptive
controller). `mode` changes where the work runs, never what is computed: `rollplex` runs each prompt's
prefix once for its n responses, `serial` every sample in full (verl's order).

Where the step runs is a runtime (rl/runtime.py): this process (`Runtime`), or a data-parallel rank
injected as `parallel` (rollplex.parallel; this module imports nothing of it), which computes what one
process does. Under a memory manager the step is fitted to its device when built (rl/step_memory.py).
`train(batch, cfg)` takes an optional config for that step alone; `self.cfg` never changes. What a failed
step leaves is in rl/errors.py. More in docs/ARCHITECTURE.md ("The RL step").
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from ..cosched import CoschedConfig, CoScheduler, PrefixRows, Timeline
from ..cosched.handover import co_scheduled, complete
from ..engine import Engine, SamplingParams
from ..memory import MemoryConfig, MemoryManager
from ..models import Qwen25VL
from .algos import AdaptiveKLController, compute_advantages, gae_advantages, kl_penalty, token_level_rewards
from .batch import RolloutBatch
from .config import RLConfig
from .dynamic_sampling import sample_groups
from .errors import TrainStepError, TrainStepFailed
from .parts import StepParts, build_parts
from .rewards import RewardFn, get_reward_fn, score_batch
from .rollout import NativeRollout, RolloutBackend, rollout_requests
from .rollout_correction import corrected_batch, rollout_correction
from .schedule import schedule_of, why_not_fused
from .scoring import logprobs
from .step_memory import fit_memory as fit_memory  # re-exported: its home before rl/step_memory.py
from .step_memory import step_sizes, update_activations
from .timing import compile_metrics
from .timing import phase_timer as _timer

log = logging.getLogger("rollplex.rl")


class RLStep:
    def __init__(self, model: Qwen25VL, engine: Engine | RolloutBackend | None, cfg: RLConfig, processor=None,
                 reward_fn: RewardFn | str | None = None, ref_model: Qwen25VL | None = None,
                 memory: MemoryManager | None = None, memory_cfg: MemoryConfig | None = None,
                 cosched: CoschedConfig | None = None, parallel=None):
        """engine: the rollout backend — a rollplex Engine over `model` (the native backend), a
        RolloutBackend (the SGLang one), or None (train() on given rollouts only).
        memory: the phase-aware memory manager the engine's KV cache was allocated under (None: every
        tensor stays resident); its plan is chosen here from the sizes of the regions and `memory_cfg`,
        together with what `cfg` and `memory_cfg` leave to it (gradient_checkpointing None,
        optimizer_offload auto) so that the step fits the device (`memory_fit`, memory/fit.py); a
        ValueError when nothing does. `self.cfg` / `self.memory_cfg` hold the settings chosen.
        cosched: the co-scheduler's configuration (used when `cfg.cosched`).
        parallel: this rank's part of a data-parallel step over a process group, built over `model` and
        the engine by `rollplex.parallel.data_parallel` (a `Colocated`), or None: this process alone.
        Data-parallel, `model` holds the full weights on every rank and the engine decodes it, or this
        rank's tensor-parallel shard of it (`parallel.tensor_parallel_copy`); then `self.model` is that
        shard, and `model` is read only here (drop it to free the whole weights).

        The parts are built and placed by rl/parts.py (`build_parts`) and the step assembled from them
        (`from_parts`); the reward function is resolved first (an unknown one: ValueError, nothing built)."""
        reward = reward_fn if callable(reward_fn) else get_reward_fn(reward_fn)
        self._assemble(build_parts(model, engine, cfg, processor, ref_model, memory, memory_cfg, parallel), reward,
                       cosched)

    @classmethod
    def from_parts(cls, parts: StepParts, reward_fn: RewardFn | str | None = None,
                   cosched: CoschedConfig | None = None) -> RLStep:
        """The step over parts already built and placed (rl/parts.py `build_parts`, which `RLStep(...)` runs):
        the runtime, rollout backend, actor, reference and critic, and the settings chosen with them."""
        step = cls.__new__(cls)
        step._assemble(parts, reward_fn if callable(reward_fn) else get_reward_fn(reward_fn), cosched)
        return step

    def _assemble(self, parts: StepParts, reward_fn: RewardFn, cosched: CoschedConfig | None) -> None:
        """The step over `parts`: the algorithm's own state (reward, KL controller, step count, schedule), and the
        memory plan the fit chose set on the manager."""
        self.runtime, self.backend = parts.runtime, parts.backend
        self.parallel = parts.data_parallel  # for what reads its group (checkpoints, the server)
        # the native engine, whose decode loop the co-scheduler hooks into; None with another backend
        self.engine = self.backend.engine if isinstance(self.backend, NativeRollout) else None
        self.model = self.runtime.policy  # what the engine decodes: the policy or its TP shard
        self.cfg = cfg = parts.cfg
        self.memory, self.memory_cfg, self.memory_fit = parts.memory, parts.memory_cfg, parts.memory_fit
        self.processor = parts.processor
        self.actor, self.reference, self.critic = parts.actor, parts.reference, parts.critic
        self.reward_fn = reward_fn
        # the KL-in-reward coefficient under kl_ctrl="adaptive" (verl's controller), moved after each step
        self.kl_ctrl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) \
            if cfg.kl_ctrl == "adaptive" else None
        self.step_idx = 0
        self.device = self.model.inv_freq.device
        self._cosched_cfg, self._cosched = cosched or CoschedConfig(), None
        self.timeline: Timeline | None = None  # set one to record phases and co-scheduled work
        self.rollout_metrics: dict = {}  # the last rollout's co-scheduling metrics
        self.schedule = schedule_of(cfg)  # the order of `run`'s work (rl/schedule.py)
        memory = self.memory
        if memory is not None:
            fit = self.memory_fit
            memory.set_plan(fit.plan, fit.to_dict())
            log.info("memory: %s", fit.summary())
            sizes, acts = self.memory_sizes(), self.activation_estimate()
            if fit.budget is not None and not fit.plan.fits(sizes, acts, fit.budget):
                # a data-parallel trainer's shards are planned from the whole model's share before they exist
                log.warning("memory: the trainer as built exceeds the plan's budget of %.1f GiB:\n%s",
                            fit.budget / 2**30, fit.plan.table(sizes, acts))
        self.refresh_vision_check()

    # ---- memory -------------------------------------------------------------------------------
    @property
    def ref(self) -> Qwen25VL | None:
        """The frozen reference model (None without one)."""
        return self.reference.model if self.reference is not None else None

    def enter(self, name: str) -> None:
        """Enter phase `name` (rollout / ref / update / update_critic) on the memory manager and on the
        rollout backend, releases before resumes: leaving the rollout the backend lets its memory go
        first; entering it the trainer's regions go first. It lasts until the next phase is entered."""
        backend_first = name != "rollout"
        if backend_first and self.backend is not None:
            self.backend.enter_phase(name)
        if self.memory is not None:
            self.memory.enter(name)
        if not backend_first and self.backend is not None:
            self.backend.enter_phase(name)

    @property
    def cosched(self) -> CoScheduler | None:
        """The prefix co-scheduler (rollplex.cosched), built when first asked for with `cfg.cosched` on; None
        while it is off."""
        if self._cosched is None and self.cfg.cosched:
            self._cosched = CoScheduler(self._cosched_cfg, self.device, memory=self.memory)
        return self._cosched

    @property
    def rollout_backend(self) -> str | None:
        """The rollout backend's name ("native", "sglang"); None without one."""
        return self.backend.name if self.backend is not None else None

    def memory_sizes(self, optimizer_offload: str | None = None) -> dict[str, int]:
        """Bytes per memory tag at steady state (the optimizer's moments exist only after its first step);
        optimizer_offload: the optimizer region's under that mode (default: the trainer's)."""
        return step_sizes(self, optimizer_offload)

    def activation_estimate(self, checkpointing: bool | None = None) -> dict[str, int]:
        """Transient bytes per phase for the plan (`update_activations`); checkpointing: default the trainer's."""
        ckpt = self.cfg.gradient_checkpointing if checkpointing is None else checkpointing
        return update_activations(self.model.cfg, self.cfg, next(self.model.parameters()).element_size(), ckpt)

    def refresh_vision_check(self) -> None:
        """Whether the reference's vision tower equals the actor's (a frozen tower never moved from the
        reference's copy), so the reference may reuse the actor's vision encodings. Call after loading
        weights."""
        same = self.ref is not None and self.cfg.freeze_vision_tower
        if same:
            with self._resident(["ref_weights"]):  # a data-parallel reference holds shards (DTensors)
                same = all(torch.equal(a, b.full_tensor() if isinstance(b, DTensor) else b)
                           for a, b in zip(self.model.visual.parameters(), self.ref.visual.parameters()))
        self.ref_same_vision = same

    def _resident(self, tags):
        return self.memory.resident(tags) if self.memory is not None else contextlib.nullcontext()

    # ---- phases -------------------------------------------------------------------------------
    def rollout(self, rows: list[dict]) -> RolloutBatch:
        if self.backend is None:
            raise ValueError("this RLStep has no rollout engine: pass rollouts to train() instead")
        prompts, params, per_prompt = rollout_requests(self.processor, rows, self.cfg, self.step_idx)
        return self.generate(prompts, params, **per_prompt)

    def generate(self, prompts: list, params: list[SamplingParams], **per_prompt) -> RolloutBatch:
        """The rollout phase on prompts (ModelInputs): the engine's samples as a RolloutBatch, with the
        co-scheduled prefix states (`cfg.cosched`) and the vision encodings (`freeze_vision_tower`)
        it carries for scoring and the update. `per_prompt`: data_sources / ground_truths / extra_infos."""
        frozen = self.keeps_vision
        handover = self.plan_handover(prompts, frozen)  # nothing without cosched
        self.enter("rollout")
        with co_scheduled(self.cosched, self.engine, handover, prompts if frozen else (), self.timeline) as cm:
            outs = self.backend.generate(prompts, params, keep_vision=frozen)
        self.rollout_metrics = cm
        batch = self.rollout_batch(prompts, outs, **per_prompt)
        batch.prefix = handover
        return batch

    def plan_handover(self, prompts: list, frozen: bool, ref_resident: bool = False) -> dict[str, PrefixRows]:
        """The prefix jobs `cfg.cosched` runs beside decode, by consumer (rollplex/cosched/handover.py): the
        reference's (when the memory plan keeps its weights resident during the rollout, or `ref_resident`:
        the fused schedule holds them there) and the old policy's (several updates per rollout). frozen: the
        prompts carry the engine's vision encodings (`keeps_vision`). A data-parallel rank plans its share
        (`NativeRollout.share`), a sharded model's as a sweep in lockstep with the other ranks'."""
        cfg, out = self.cfg, {}
        if not cfg.cosched or self.engine is None:
            return out
        per_job = self.cosched.config.job_prompts
        only = self.backend.share(len(prompts))
        if self.ref is not None and cfg.kl_coef > 0 and (
                ref_resident or self.memory is None or self.memory.plan.get("rollout", "ref_weights") == "resident"):
            # a frozen tower's encodings come from the engine's prefill, unless the reference's tower differs
            shared = frozen and self.ref_same_vision
            ref_prompts = prompts if shared or not frozen else [replace(p, vision_embeds=None) for p in prompts]
            out["ref"] = PrefixRows.plan(self.ref, ref_prompts, per_job, "ref", external_vision=shared, only=only,
                                         gather=self.reference.sweep_gather())
        if cfg.num_updates > 1:  # the policy, or the trainer's shards (a tensor-parallel engine holds only its own)
            scorer = self.runtime.old_scorer(self.actor, cfg)
            out["old"] = PrefixRows.plan(scorer.model, prompts, per_job, "old", external_vision=frozen, only=only,
                                         gather=scorer.sweep_gather())
        return out

    def complete_handover(self, batch: RolloutBatch, key: str, m: dict) -> None:
        """The handed-over prefix work under `key` never admitted beside decode, run standalone (its normal
        phase, timed into `m`; it calibrates the co-scheduler)."""
        rows = batch.prefix.get(key)
        if rows is not None:
            m[f"rollplex/prefix_{key}_normal_phase_s"] = complete(self.cosched, rows, self.device)

    def rollout_batch(self, prompts: list, outs: list, **per_prompt) -> RolloutBatch:
        """The backend's RequestOutputs of `prompts` as a RolloutBatch; its prompts carry the prefill's
        vision encodings when the step reuses them (`keeps_vision`)."""
        batch = RolloutBatch.from_outputs(prompts, outs, pad_id=self.pad_id, **per_prompt)
        if self.keeps_vision:
            batch.prompts = [p if o.vision_embeds is None else replace(p, vision_embeds=o.vision_embeds)
                             for p, o in zip(batch.prompts, outs)]
        return batch

    def sample(self, prompts: list, params: list[SamplingParams], keep_vision: bool = False) -> list:
        """The rollout phase on prompts without co-scheduling: the backend's RequestOutputs, one per
        prompt (the server's /rollout when the backend is not its own engine loop, or over a process
        group, where each rank samples its share)."""
        if self.backend is None:
            raise ValueError("this RLStep has no rollout engine")
        self.enter("rollout")
        return self.backend.generate(prompts, params, keep_vision=keep_vision)  # data-parallel: every rank calls

    def compute_rewards(self, batch: RolloutBatch, reward: RewardFn | str | None = None, cfg: RLConfig | None = None,
                        max_new_tokens: int | None = None) -> tuple[torch.Tensor, dict]:
        """Rewards [N] of a rollout's samples and their extra metrics, by `reward` (a function, a
        registered name or module:function) or this step's reward function, with `cfg`'s overlong
        reward shaping (default: `self.cfg`; max_new_tokens: the rollout's, default cfg's; rl/rewards.py).
        ValueError for an unknown reward, a reward function that fails, or a non-finite score."""
        fn = self.reward_fn if reward is None else reward if callable(reward) else get_reward_fn(reward)
        cfg = cfg or self.cfg
        _, rewards, extra = score_batch(fn, batch, max_new_tokens or cfg.max_new_tokens, cfg.overlong_buffer_len,
                                        cfg.overlong_penalty_factor, name=reward if isinstance(reward, str) else None)
        return rewards, extra

    def train(self, batch: RolloutBatch, cfg: RLConfig | None = None,
              old_logprobs: torch.Tensor | None = None, nonfinite: str = "skip") -> dict:
        """Reference scoring, advantages and the actor update for a batch with rewards; `cfg`: this
        step's config (default: `self.cfg`); `old_logprobs` [N, R]: the PPO ratio's denominator for
        an off-policy batch (its sampling logprobs; default: the current policy's).

        Scoring backs off on out-of-memory errors like the update (rl/scoring.py). A mini-batch with a
        non-finite loss or gradient norm is skipped (`nonfinite="skip"`, verl's behaviour, reported in
        `actor/skipped_updates`) or raises NonFiniteUpdate ("raise"). `step_idx` counts the steps that
        changed the weights: a failure before the first optimizer step (TrainOOM / NonFiniteUpdate with
        nothing applied, or any error in scoring) leaves it, the weights, the optimizer state and the LR
        schedule as they were, the critic's included; one after it (rl/errors.py) counts the step, as the LR
        schedule counts its applied optimizer steps, and the critic is not trained in it. A failure in the
        critic's update after the actor's counts the step too. Every error after an optimizer step is a
        TrainStepError saying what was applied (TrainStepFailed, caused by it, for one that is neither out
        of memory nor a non-finite update)."""
        compiled: dict = {}
        with self._failures_reported(), compile_metrics(compiled):
            m = self._train(batch, cfg, old_logprobs, nonfinite)
        return {**m, **compiled}

    def _train(self, batch: RolloutBatch, cfg: RLConfig | None, old_logprobs: torch.Tensor | None,
               nonfinite: str) -> dict:
        cfg, m = cfg or self.cfg, {}
        if batch.rewards is None:
            raise ValueError("the batch has no rewards")
        if cfg.uses_critic and self.critic is None:
            raise ValueError("adv_estimator='gae' needs the critic, which is built with the step: build it (start the "
                             "server) with adv_estimator='gae'")
        batch, ref_batch = self.training_views(batch)
        ref_lp = values = returns = None
        tl = self.timeline
        if self.uses_reference(cfg):
            with _timer(m, "ref", self.device, tl):
                self.enter("ref")
                self.complete_handover(batch, "ref", m)
                ref_lp = self.reference_logprobs(ref_batch, cfg)
        if cfg.uses_critic:  # the values of the responses before the update: GAE's baseline, the value clip's centre
            with _timer(m, "values", self.device, tl):
                self.enter("ref")
                values = self.critic.values(batch, cfg)
        penalty, reward_kl, kl_m = self.kl_reward_penalty(batch, ref_lp, cfg)
        m.update(kl_m)
        if cfg.uses_critic:
            tok = token_level_rewards(batch.rewards, batch.mask, penalty)
            adv, returns = gae_advantages(tok, values, batch.mask, cfg.gamma, cfg.lam)
            rewards = tok.sum(-1)
        else:
            adv, rewards = compute_advantages(cfg.adv_estimator, batch.rewards, batch.group, batch.mask, penalty,
                                              cfg.norm_adv_by_std, cfg.gamma, cfg.singleton_adv, batch.baselines)
        # verl's trainer.critic_warmup: the first steps update the critic only
        train_actor = not (cfg.uses_critic and self.step_idx < cfg.critic_warmup)
        old = old_logprobs
        if old is None and train_actor:
            with _timer(m, "old_log_prob", self.device, tl):
                self.enter("ref")
                self.complete_handover(batch, "old", m)
                old = self.actor.old_logprobs(batch, cfg, self.runtime.old_scorer(self.actor, cfg))
        batch.prefix = {}  # the prefix states are consumed: free them before the update
        # rollout correction over the whole batch (batch-normalised weights, rejection): what the update trains
        train_batch = corrected_batch(batch, old, cfg) if train_actor else batch

        def actor_update() -> tuple[dict, torch.Tensor | None]:
            stats, first_lp = self.actor.update(train_batch, adv, ref_lp if cfg.use_kl_loss else None, old,
                                                self.step_idx, cfg, nonfinite)
            return stats, old if old is not None and old_logprobs is None else first_lp

        self.update(batch, adv, rewards, reward_kl, cfg, m, actor_update if train_actor else None,
                    (returns, values) if cfg.uses_critic else None, nonfinite)
        return m

    # ---- the stages the schedules share (train() above, the group pipeline in rl/pipeline.py) ---------------
    def training_views(self, batch: RolloutBatch) -> tuple[RolloutBatch, RolloutBatch]:
        """(the batch as the actor trains it, as the reference scores it): stored vision encodings are
        dropped where the tower must run — a trained tower (they would cut its gradient), a reference
        whose tower differs from the actor's."""
        if not self.cfg.freeze_vision_tower and any(p.vision_embeds is not None for p in batch.prompts):
            batch = replace(batch, prompts=[replace(p, vision_embeds=None) for p in batch.prompts])
        ref_batch = batch
        if any(p.vision_embeds is not None for p in batch.prompts) and not self.ref_same_vision:
            ref_batch = replace(batch, prompts=[replace(p, vision_embeds=None) for p in batch.prompts])
        return batch, ref_batch

    def uses_reference(self, cfg: RLConfig) -> bool:
        return self.ref is not None and cfg.kl_coef > 0

    def reference_logprobs(self, batch: RolloutBatch, cfg: RLConfig) -> torch.Tensor:
        """The reference's logprobs [N, R] of the batch's responses (backs off on OOM, rl/scoring.py)."""
        return self.reference.score(batch, logprobs(cfg.temperature), cfg, prefix_key="ref")

    def kl_reward_penalty(self, batch: RolloutBatch, ref_lp: torch.Tensor | None,
                          cfg: RLConfig) -> tuple[torch.Tensor | None, float | None, dict]:
        """With the KL as a reward penalty (use_kl_loss=False; policy = rollout logprobs): (the per-token
        penalty [N, R], coefficient included, as verl's token_level_rewards; the measured KL; metrics)."""
        if ref_lp is None or cfg.use_kl_loss:
            return None, None, {}
        mask = batch.mask.float()
        kld = kl_penalty(batch.rollout_logprobs, ref_lp, cfg.kl_penalty) * mask
        coef = self.kl_ctrl.value if self.kl_ctrl is not None else cfg.kl_coef
        # verl's measured KL: the mean over samples of each sample's per-token mean
        reward_kl = float((kld.sum(-1) / mask.sum(-1).clamp_min(1)).mean())
        return coef * kld, reward_kl, {"critic/kl_penalty": float(kld.sum(-1).mean()),
                                       "actor/reward_kl_penalty": reward_kl, "actor/reward_kl_penalty_coeff": coef}

    def update(self, batch: RolloutBatch, adv: torch.Tensor, rewards: torch.Tensor, reward_kl: float | None,
               cfg: RLConfig, m: dict, actor_update: Callable[[], tuple[dict, torch.Tensor | None]] | None,
               critic_targets: tuple[torch.Tensor, torch.Tensor] | None = None, nonfinite: str = "skip") -> None:
        """The step's tail, both schedules': the actor's update (`actor_update() -> (its metrics, the
        logprobs the trainer saw [N, R] or None)`, what writes its weights; None during the critic's
        warm-up), then the critic's on `critic_targets` (GAE returns, values before the update [N, R]),
        then the step counted and its metrics into `m`. adv: the advantages [N] or [N, R]; rewards: the
        sequence rewards [N]; reward_kl: the KL measured for the adaptive controller."""
        tl, n, train_lp = self.timeline, batch.num_samples, None
        if actor_update is not None:
            with _timer(m, "update_actor", self.device, tl):
                self.enter("update")
                stats, train_lp = self._applying(reward_kl, n, actor_update)
        else:
            stats = {"rollplex/critic_warmup": 1.0}
        if critic_targets is not None:
            returns, values = critic_targets
            # after the actor's (verl: before; neither reads the other's update), so that an actor failing before
            # its first optimizer step leaves the critic as it was too; a critic failing after the actor's update
            # counts the step, whose weights changed
            try:
                with _timer(m, "update_critic", self.device, tl):
                    self.enter("update_critic")
                    m.update(self.critic.update(batch, returns, values, self.step_idx, cfg, nonfinite))
            except Exception as e:
                raise self._critic_failed(e, actor_update is not None, m, stats, reward_kl, n)  # noqa: B904
        self._after_update(m, stats, reward_kl, n)
        m.update(self._batch_metrics(batch, adv, rewards, train_lp, cfg))
        if critic_targets is not None:
            sel = batch.mask > 0
            # verl's: how much of the returns' variance the values explain (1: all; <= 0: none)
            m["critic/vf_explained_var"] = float(1 - (returns[sel] - values[sel]).var() / (returns[sel].var() + 1e-5))
            m.update({"critic/values/mean": float(values[sel].mean()), "critic/values/max": float(values[sel].max()),
                      "critic/values/min": float(values[sel].min()), "critic/returns/mean": float(returns[sel].mean()),
                      "critic/returns/max": float(returns[sel].max()), "critic/returns/min": float(returns[sel].min())})

    def _applying(self, reward_kl: float | None, n: int, apply):
        """Run `apply` (what writes the weights); a failure after some weights changed still counts the step,
        moves the KL controller and syncs what the engine decodes."""
        try:
            return apply()
        except TrainStepError as e:
            if e.weights_changed:  # part of the step was applied: counted, and what the engine decodes follows
                self.step_idx += 1
                self._update_kl_ctrl(reward_kl, n)
                self.runtime.sync_weights()
            raise

    @contextmanager
    def _failures_reported(self):
        """Any error of the body once the step counted (its weights changed) as a TrainStepError saying what
        was applied: the trainers' optimizer steps of this step."""
        step0 = self.step_idx
        for trainer in (self.actor, self.critic):
            if trainer is not None:
                trainer.applied = 0
        try:
            yield
        except Exception as e:
            if isinstance(e, TrainStepError) or self.step_idx == step0:
                raise
            applied = self.actor.applied + (self.critic.applied if self.critic is not None else 0)
            raise TrainStepFailed(f"the train step failed after its update was applied: {type(e).__name__}: {e}",
                                  applied) from e

    def _critic_failed(self, error: Exception, trained_actor: bool, m: dict, stats: dict, reward_kl: float | None,
                       n: int) -> Exception:
        """What the step raises when the critic's update failed with `error`: the step counts when the actor's
        update ran before it or the critic's applied an optimizer step, and the error then says what of the
        whole step (the actor's optimizer steps and the critic's) was applied."""
        critic_changed = isinstance(error, TrainStepError) and error.weights_changed
        if trained_actor or critic_changed:
            self._after_update(m, stats, reward_kl, n)
        if not trained_actor or not self.actor.applied:
            return error
        kw = dict(partial_update=error.partial_update, chunks_written=error.chunks_written,
                  chunks_total=error.chunks_total, torn=error.torn) if isinstance(error, TrainStepError) else {}
        cls = type(error) if isinstance(error, TrainStepError) else TrainStepFailed
        applied = self.actor.applied + (error.applied_updates if isinstance(error, TrainStepError) else 0)
        out = cls(f"the critic's update failed after the actor's was applied: {error}", applied, **kw)
        out.__cause__ = error
        return out

    def _after_update(self, m: dict, stats: dict, reward_kl: float | None, n: int) -> None:
        self.step_idx += 1  # the weights changed: counted before anything else can fail
        self._update_kl_ctrl(reward_kl, n)
        # data-parallel: the trainer's new weights into what the engine decodes
        self.runtime.sync_weights(m, lambda: _timer(m, "sync_weights", self.device, self.timeline))
        m.update(stats)
        if self.memory is not None:
            m.update(self.memory.take_metrics())

    def _batch_metrics(self, batch: RolloutBatch, adv: torch.Tensor, rewards: torch.Tensor,
                       train_lp: torch.Tensor | None, cfg: RLConfig) -> dict:
        m = {}
        if batch.rollout_logprobs is not None and train_lp is not None:
            sel = batch.mask > 0
            diff = (batch.rollout_logprobs.exp() - train_lp.exp()).abs()[sel]
            m["training/rollout_probs_diff_mean"] = float(diff.mean())
            m["training/rollout_probs_diff_max"] = float(diff.max())
        if cfg.rollout_corr.active and batch.rollout_logprobs is not None and train_lp is not None:
            m.update(rollout_correction(train_lp, batch.rollout_logprobs, batch.mask, cfg.rollout_corr)[2])
        lens = batch.mask.sum(-1)
        adv_tok = adv[batch.mask > 0] if adv.dim() == 2 else adv  # per-token advantages: over response tokens
        m["actor/kl_coef"] = self.kl_ctrl.value if self.kl_ctrl is not None else cfg.kl_coef
        m.update({
            "critic/score/mean": float(batch.rewards.mean()),
            "critic/rewards/mean": float(rewards.mean()),
            "critic/advantages/mean": float(adv_tok.mean()),
            "critic/advantages/max": float(adv_tok.max()),
            "response_length/mean": float(lens.mean()),
            "response_length/max": float(lens.max()),
            "rollplex/prefix_dedup_ratio": batch.num_samples / batch.num_prompts if cfg.mode == "rollplex" else 1.0,
        })
        return m

    def _update_kl_ctrl(self, reward_kl: float | None, n: int) -> None:
        """The adaptive controller follows the KL measured in a step that changed the weights (verl: after
        applying the penalty); a step that failed with nothing changed leaves it as it was."""
        if self.kl_ctrl is not None and reward_kl is not None:
            self.kl_ctrl.update(reward_kl, n)

    def policy_state(self, keep: bool = True) -> dict[str, torch.Tensor] | None:
        """{name: whole parameter} of the policy. Under a group whose engine holds tensor-parallel
        shards they are gathered from the trainer's shards: a collective every rank calls, the result
        (on the host) kept where `keep`. Otherwise the policy's own tensors (detached)."""
        return self.runtime.policy_state(self.model, self.actor.model, keep)

    def step(self, rows: list[dict], more_rows: Callable[[], list[dict]] | None = None) -> dict:
        """The full step on a batch of dataset rows; returns verl-named metrics. With `cfg.filter_groups`
        (DAPO's dynamic sampling, rl/dynamic_sampling.py) groups whose samples' rewards are all equal are
        dropped and the rows `more_rows()` returns (the driver's next rows) rolled out until len(rows) remain."""
        if self.cfg.filter_groups:
            m: dict = {}
            t0 = time.perf_counter()
            with self._speculation(m):
                batch = sample_groups(self, rows, more_rows, m)
            m.update(self.train(batch))
            return self._step_metrics(batch, m, t0)
        prompts, params, per_prompt = rollout_requests(self.processor, rows, self.cfg, self.step_idx)
        return self.run(prompts, params, **per_prompt)[1]

    def run(self, prompts: list, params: list[SamplingParams], rewards=None,
            **per_prompt) -> tuple[RolloutBatch, dict]:
        """The full step on prompts (ModelInputs, one SamplingParams each), in `cfg.schedule`'s order:
        (the rolled-out batch with its rewards, verl-named metrics). rewards: `fn(batch, prompt_ids) ->
        (scores [n], metrics)` over a batch of whole groups, samples in prompt order (default: the step's
        reward function); per_prompt: data_sources / ground_truths / extra_infos."""
        if self.backend is None:
            raise ValueError("this RLStep has no rollout engine: pass rollouts to train() instead")
        rewards = rewards or (lambda b, _ids: self.compute_rewards(b))
        m: dict = {}
        t0 = time.perf_counter()
        with self._failures_reported(), compile_metrics(m), self._speculation(m):
            batch = self.schedule.run(self, prompts, params, rewards, per_prompt, m)
        return batch, self._step_metrics(batch, m, t0)

    @contextmanager
    def _speculation(self, m: dict):
        """The engine's speculative decoding during the block (nothing with it off): verification passes,
        draft tokens proposed, and of them accepted, as `rollout/spec_*` (mean accepted length: draft tokens
        kept per sequence and pass; backed off, the drafts scored in shadow and their accepted tokens)."""
        spec = self.engine.spec if self.engine is not None else None
        before = spec.stats.copy() if spec is not None else None
        yield
        if before is None:
            return
        d = spec.stats.since(before)
        m.update({"rollout/spec_verify_steps": d.steps, "rollout/spec_draft_tokens": d.drafted,
                  "rollout/spec_accepted_tokens": d.accepted, "rollout/spec_mean_accepted": d.mean_accepted,
                  "rollout/spec_acceptance_rate": d.acceptance_rate, "rollout/spec_shadow_drafts": d.shadow_drafts,
                  "rollout/spec_shadow_accepted_tokens": d.shadow_accepted})

    def _step_metrics(self, batch: RolloutBatch, m: dict, t0: float) -> dict:
        m["timing_s/step"] = time.perf_counter() - t0
        tokens = sum(len(batch.prompts[g].input_ids) for g in batch.group.tolist()) + float(batch.mask.sum())
        m["perf/throughput"] = tokens / m["timing_s/step"]
        m["training/global_step"] = self.step_idx
        return m

    def fused_unsupported(self) -> str | None:
        """Why this step cannot run the fused schedule (None: it can; rl/schedule.py)."""
        return why_not_fused(self)

    @property
    def pad_id(self) -> int:
        return self.model.cfg.pad_token_id or 0

    @property
    def keeps_vision(self) -> bool:
        """Whether rollouts keep the prefill's vision encodings for scoring and the update."""
        return self.cfg.freeze_vision_tower and self.cfg.mode == "rollplex"
