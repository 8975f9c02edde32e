"""Configuration of the RL step (one dataclass, verl's names where they exist).

Defaults follow verl where Rollplex used to differ, each with a named option for the old behaviour:
a group of one sample gets the reward itself as advantage (`singleton_adv="zero"`: 0); the LR
schedule advances once per train step (`lr_schedule_unit="optimizer_step"`: once per mini-batch);
the KL-in-reward penalty uses k1 (`kl_penalty`; it used `kl_loss_type`); dual clip 3.0
(`dual_clip=None`: off). Every option with its verl name, default and what differs from verl:
docs/ALGORITHMS.md (estimators, losses, KL, rollout correction `rollout_is*` / `rollout_rs*`, DAPO's
`overlong_buffer_*` and `filter_groups*`); PPO with a critic (`adv_estimator="gae"`, `critic_*`,
`cliprange_value`): docs/ARCHITECTURE.md.

Per-step overrides: the fields declared with `per_step(default, **bounds)` are the ones a server's
/train_step may set for one step, bounded to what a step can use (an lr of 1000 destroys the policy in
one step); names of an estimator / loss / filter metric are checked by `__post_init__`. The LR-schedule
unit, the KL controller, the critic's warm-up and checkpoint are not: they define what persists across
steps; max_num_gen_batches and filter_groups_partial do not apply to a server (it rolls out nothing
itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .algos import ADV_ESTIMATORS, AGG_MODES, KL_KINDS, POLICY_LOSSES, SINGLETON_ADV, PolicyLossParams
from .fuse_gate import POLICIES as FUSE_ADMISSIONS
from .fuse_gate import parse_sms_by_batch
from .microbatch import MicroBatching
from .rollout_correction import RolloutCorrection

PER_STEP = "per_step"  # the field metadata key of a per-step override's bounds


def per_step(default, **bounds):
    """A field that a server's /train_step may override for one step, within `bounds` (pydantic's gt / ge /
    lt / le; none: any value RLConfig accepts). The request schema is built from these fields
    (server/schemas.py): declaring one here is what makes it overridable."""
    return field(default=default, metadata={PER_STEP: bounds})


MODES = ("rollplex", "serial")
LR_SCHEDULES = ("constant", "cosine")
LR_SCHEDULE_UNITS = ("step", "optimizer_step")
SCHEDULES = ("phased", "fused", "auto")
KL_CTRLS = ("fixed", "adaptive")
# what dynamic sampling compares within a group (verl's filter_groups.metric): seq_reward, the reward
# trained on (after overlong shaping); score, the reward function's score before it; or any other key the
# reward function returns in its dict (acc, format, ...), checked when the rewards are scored
FILTER_GROUPS_METRICS = ("seq_reward", "score")


@dataclass
class RLConfig:
    mode: str = "rollplex"  # rollplex: shared-prefix scoring/training; serial: verl's per-sample order
    # rollout
    n: int = 8  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    # algorithm
    # grpo | dr_grpo | rloo | opo | grpo_passk | gpg | reinforce_plus_plus | reinforce_plus_plus_baseline |
    # gae (PPO with a critic) | remax (greedy baseline, rl/remax.py); rl/algos.py, docs/ALGORITHMS.md
    adv_estimator: str = per_step("grpo")
    norm_adv_by_std: bool = per_step(True)  # grpo and grpo_passk (dr_grpo is grpo without it)
    singleton_adv: str = per_step("reward")  # a group of one sample: the reward itself (verl) | zero
    # reinforce_plus_plus, gae: discount of the per-token return (verl's algorithm.gamma)
    gamma: float = per_step(1.0, ge=0.0, le=1.0)
    # PPO with a critic (adv_estimator="gae", rl/critic.py; see the docstring)
    lam: float = per_step(1.0, ge=0.0, le=1.0)  # GAE's lambda (verl's algorithm.lam)
    # the value loss's clip around the values scored before the update
    cliprange_value: float = per_step(0.5, gt=0.0, le=100.0)
    # the critic's AdamW lr (constant; betas, weight decay and grad clip: the actor's)
    critic_lr: float = per_step(1e-5, gt=0.0, le=1e-2)
    critic_warmup: int = 0  # the first steps train the critic only (verl's trainer.critic_warmup)
    # the critic's lr: critic_lr warmed up linearly over this many steps, then `lr_schedule` over `total_steps`
    # like the actor's, advanced once per step (verl's critic.optim.lr_warmup_steps and warmup_style)
    critic_lr_warmup_steps: int = 0
    critic_model_path: str | None = None  # HF directory of the critic; None: a copy of the policy
    # vanilla (PPO-clip, dual clip) | gspo (sequence-level ratio) | sapo | cispo | gpg | clip_cov | kl_cov |
    # geo_mean (GMPO) | reinforce; rl/algos.py, docs/ALGORITHMS.md
    policy_loss: str = per_step("vanilla")
    clip_ratio_low: float = per_step(0.2, ge=0.0, le=1.0)  # gspo: verl's recipe uses 3e-4
    clip_ratio_high: float = per_step(0.2, ge=0.0, le=10.0)  # gspo: verl's recipe uses 4e-4
    dual_clip: float | None = per_step(3.0, gt=1.0, le=100.0)  # verl's clip_ratio_c; None disables
    loss_agg_mode: str = per_step("token-mean")
    # seq-mean-token-sum-norm's constant divisor (default: max_new_tokens)
    loss_agg_norm: float | None = per_step(None, gt=0.0, le=float(1 << 20))
    # truncated importance sampling (verl's tis_imp_ratio_cap): the pg loss per token times
    # min(exp(old - rollout logprob), cap) when the batch has rollout logprobs; None: off
    tis_imp_ratio_cap: float | None = per_step(None, gt=0.0, le=100.0)
    # rollout correction (verl's algorithm.rollout_correction, rl/rollout_correction.py): IS weights per token or
    # sequence truncated at rollout_is_threshold (optionally batch-normalised), rejection of the tokens (IcePop) or
    # sequences whose weight lies outside [rollout_rs_threshold_lower, rollout_rs_threshold], and the veto of
    # sequences with a token weight under rollout_token_veto_threshold; all off by default
    rollout_is: str | None = per_step(None)  # token | sequence
    rollout_is_threshold: float = per_step(2.0, gt=0.0, le=1e6)
    rollout_is_batch_normalize: bool = per_step(False)
    rollout_rs: str | None = per_step(None)  # token | sequence | geometric
    rollout_rs_threshold: float | None = per_step(None, gt=0.0, le=1e6)
    rollout_rs_threshold_lower: float | None = per_step(None, gt=0.0, le=1e6)  # default 1 / rollout_rs_threshold
    rollout_token_veto_threshold: float | None = per_step(None, gt=0.0, le=1.0)
    # sapo's gate temperatures where A > 0 / A <= 0 (verl's actor.tau_pos / tau_neg)
    tau_pos: float = per_step(1.0, gt=0.0, le=100.0)
    tau_neg: float = per_step(1.05, gt=0.0, le=100.0)
    # clip_cov: the fraction of tokens cut, drawn from those with covariance in (lb, ub) (verl's
    # actor.policy_loss.clip_cov_ratio / clip_cov_lb / clip_cov_ub)
    clip_cov_ratio: float = per_step(0.0002, gt=0.0, le=1.0)
    clip_cov_lb: float = per_step(1.0, ge=-1e6, le=1e6)
    clip_cov_ub: float = per_step(5.0, ge=-1e6, le=1e6)
    # kl_cov: the fraction of tokens of largest covariance given ppo_kl_coef |log ratio| (verl's
    # actor.policy_loss.kl_cov_ratio / ppo_kl_coef)
    kl_cov_ratio: float = per_step(0.0002, gt=0.0, le=1.0)
    ppo_kl_coef: float = per_step(0.1, ge=0.0, le=100.0)
    kl_coef: float = per_step(0.0, ge=0.0, le=10.0)
    use_kl_loss: bool = per_step(True)  # True: KL term in the loss (GRPO); False: KL penalty in the reward
    # the KL loss's estimator; "+" (k1+, k3+, ...): its value, k2's gradient (straight-through)
    kl_loss_type: str = per_step("low_var_kl")
    kl_penalty: str = per_step("kl")  # the KL-in-reward estimator (verl's algorithm.kl_penalty, default k1)
    # KL-in-reward coefficient: fixed (kl_coef) or verl's adaptive controller, started at kl_coef and
    # moved towards kl_target each step (horizon kl_horizon samples); adaptive needs use_kl_loss=False
    kl_ctrl: str = "fixed"
    kl_target: float = 0.1
    kl_horizon: int = 10000
    entropy_coeff: float = per_step(0.0, ge=-1.0, le=1.0)
    # DAPO's overlong reward shaping (verl's reward_model.overlong_buffer): 0 turns it off; see the docstring
    overlong_buffer_len: int = per_step(0, ge=0, le=1 << 20)
    overlong_penalty_factor: float = per_step(1.0, ge=0.0, le=10.0)
    # DAPO's dynamic sampling (verl's algorithm.filter_groups): see the docstring
    filter_groups: bool = per_step(False)
    filter_groups_metric: str = per_step("seq_reward")
    max_num_gen_batches: int = 0  # rollouts per step at most; 0: unbounded (verl)
    filter_groups_partial: bool = False  # at the bound, train on the groups kept instead of raising (verl raises)
    # optimisation
    lr: float = per_step(1e-6, gt=0.0, le=1e-2)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = per_step(1.0, gt=0.0, le=1e4)
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    # what advances the schedule: one train step (verl), or each optimizer step (mini-batch)
    lr_schedule_unit: str = "step"
    total_steps: int = 1000  # for the cosine schedule
    ppo_epochs: int = per_step(1, ge=1, le=16)
    # mini-batches per rollout (each is one optimizer step). The first epoch's are consecutive runs of the order
    # the groups finished decoding in (prompt order where the backend does not report it), so the first holds
    # the groups that finished first; later epochs deal a seeded permutation (rl/actor.py)
    ppo_mini_batches: int = per_step(1, ge=1, le=256)
    # micro-batches (`micro_batching`, microbatch.py): what one forward/backward of scoring or the update holds
    # prompts per forward/backward (all their samples together)
    micro_batch_prompts: int = per_step(4, ge=1, le=4096)
    micro_batch_samples: int = per_step(8, ge=1, le=65536)  # serial mode: sequences per forward/backward
    # token budget per forward/backward (verl: use_dynamic_bsz + ppo_max_token_len_per_gpu): when set, a
    # micro-batch takes prompts with all their samples (rollplex) or sequences (serial), in order, while
    # their tokens fit, at least one; it replaces the two counts above. Tokens are what the pass
    # computes: rollplex counts each prompt once, serial counts it per sequence.
    micro_batch_max_tokens: int | None = per_step(None, ge=1, le=1 << 24)
    # rollplex mode: True packs a micro-batch's prompts and responses into one sequence (one pass, no
    # padding, one varlen attention call per layer); False runs a prefix pass, then the padded
    # responses over its PrefixState. Same values (tests hold both to the serial mode). Packed is the
    # default because it is faster and needs about half the memory of the padded responses, which is
    # what lets 4 prompts x 8 samples fit a micro-batch on one GPU (docs/BENCHMARKS.md).
    # serial mode: True packs the micro-batch's full sequences without padding (verl's
    # use_remove_padding, as its recipes run); False right-pads them to the longest ("serial-padded").
    packed: bool = True
    # per-layer activation checkpointing of the decoder / the vision tower in the actor's forward/backward
    # (verl: enable_gradient_checkpointing): activations stop growing with depth for about one extra forward.
    # None: the memory plan's choice (on only when the step would not fit the device without it; off without
    # a memory manager); RLStep.cfg holds what was chosen
    gradient_checkpointing: bool | None = None
    vision_gradient_checkpointing: bool | None = None
    # the vision tower gets no gradient (verl/EasyR1 freeze_vision_tower): in rollplex mode the engine's
    # prefill encodings then stand in for the reference's and the actor's vision passes (one vision pass
    # per prompt per step); serial mode re-encodes per sample, as verl does
    freeze_vision_tower: bool = False
    # rollplex mode: run the reference's prefix (vision + prompt prefill; the old policy's too when
    # num_updates > 1) beside the rollout's decode steps on spare device capacity (rollplex.cosched), and
    # hand the prefix states to scoring; same values as without it. Under schedule="fused" each chunk of
    # finished groups reads its prompts' prefix states, taking over the jobs not finished yet (cosched/handover.py)
    cosched: bool = False
    # how a whole step (`RLStep.step`) runs its stages (rl/pipeline.py): "phased" rolls out, then scores and
    # trains the batch; "fused" feeds each prompt group, as its samples finish, through the reward, the
    # reference, the advantages and the actor's forward/backward while the rest of the rollout decodes, and
    # steps the optimizer once after the last group (same result up to summation order). With several
    # mini-batches only the first one's groups train beside the rollout; the others follow its optimizer
    # step as phased. Data-parallel: each rank's pipeline takes its own engine's groups
    schedule: str = "phased"
    # "auto" (rl/auto_schedule.py) runs fused or phased per step, whichever took fewer seconds per token on
    # earlier steps (fused by at least auto_margin, and only while it trains some group beside decode), trying
    # the other one again every auto_reprobe_steps steps. Not the default: which one ran shows in the weights
    # at the level of summation order, so a resumed run need not repeat a continuous one bit for bit
    auto_reprobe_steps: int = 16
    auto_margin: float = 0.01
    # fused: start consuming groups when at most this fraction of them is still decoding (1.0: at once)
    fuse_below: float = 1.0
    # fused, on a GPU: the work beside decode runs in a green context of this many SMs (0: a low-priority
    # stream over every SM); decode keeps the primary context
    fuse_sms: int = 0
    # fused, on a GPU: the partition by decode batch, "MIN_BATCH:SMS" entries ("64:66": while at least 64
    # sequences decode, a chunk starts in a green context of 66 SMs); below every entry, fuse_sms
    fuse_sms_by_batch: tuple[str, ...] = ()
    # fused: "always" runs finished chunks beside decode; "pays" holds them in decode-batch buckets where the
    # decode time they added exceeded the time they saved, as measured over earlier steps (rl/fuse_gate.py)
    fuse_admission: str = "always"
    # fused: a chunk of groups closes at micro_batch_prompts groups, or at this many tokens (None: no budget)
    fuse_chunk_tokens: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name, allowed in (("adv_estimator", ADV_ESTIMATORS), ("singleton_adv", SINGLETON_ADV),
                              ("policy_loss", POLICY_LOSSES), ("loss_agg_mode", AGG_MODES),
                              ("kl_loss_type", KL_KINDS), ("kl_penalty", KL_KINDS), ("kl_ctrl", KL_CTRLS),
                              ("lr_schedule", LR_SCHEDULES), ("lr_schedule_unit", LR_SCHEDULE_UNITS),
                              ("schedule", SCHEDULES),
                              ("fuse_admission", FUSE_ADMISSIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not (isinstance(self.filter_groups_metric, str) and self.filter_groups_metric.isidentifier()):
            raise ValueError(f"filter_groups_metric must be seq_reward, score or a key the reward function returns "
                             f"(a name), got {self.filter_groups_metric!r}")
        _ = self.policy_loss_params  # ValueError on a bad sapo / clip_cov / kl_cov hyperparameter
        if self.tis_imp_ratio_cap is not None and self.rollout_is is not None:
            raise ValueError("tis_imp_ratio_cap is rollout_is='token' with rollout_is_threshold=cap: set one of them")
        if self.adv_estimator == "grpo_passk" and self.n < 2:
            raise ValueError("adv_estimator='grpo_passk' compares a group's two best samples: it needs n >= 2")
        if self.adv_estimator == "dr_grpo" and self.loss_agg_mode != "seq-mean-token-sum-norm":
            raise ValueError("adv_estimator='dr_grpo' needs loss_agg_mode='seq-mean-token-sum-norm' (Dr.GRPO's "
                             "constant-normalised token sum)")
        if not 0.0 <= self.gamma <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise ValueError("gamma and lam must be within [0, 1]")
        if not self.cliprange_value > 0 or not self.critic_lr > 0 or not self.critic_lr < float("inf"):
            raise ValueError("cliprange_value and critic_lr must be finite and > 0")
        if self.critic_warmup < 0 or self.critic_lr_warmup_steps < 0:
            raise ValueError("critic_warmup and critic_lr_warmup_steps must be >= 0")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError("dual_clip must be > 1 (or None)")
        for name in ("loss_agg_norm", "tis_imp_ratio_cap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (or None)")
        if self.kl_ctrl == "adaptive" and self.use_kl_loss:
            raise ValueError("kl_ctrl='adaptive' controls the KL-in-reward penalty: it needs use_kl_loss=False")
        if not self.kl_target > 0 or self.kl_horizon < 1:
            raise ValueError("kl_target must be > 0 and kl_horizon >= 1")
        for name in ("n", "max_new_tokens", "ppo_epochs", "ppo_mini_batches", "micro_batch_prompts",
                     "micro_batch_samples", "total_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 0 <= self.overlong_buffer_len <= self.max_new_tokens:
            raise ValueError(f"overlong_buffer_len must be within [0, max_new_tokens={self.max_new_tokens}] (0: "
                             f"off), got {self.overlong_buffer_len}")
        if not 0.0 <= self.overlong_penalty_factor < float("inf"):
            raise ValueError(f"overlong_penalty_factor must be finite and >= 0, got {self.overlong_penalty_factor}")
        if self.max_num_gen_batches < 0:
            raise ValueError("max_num_gen_batches must be >= 0 (0: unbounded)")
        if self.micro_batch_max_tokens is not None and self.micro_batch_max_tokens < 1:
            raise ValueError("micro_batch_max_tokens must be >= 1 (or None)")
        if self.temperature <= 0:
            raise ValueError("RL rollouts need temperature > 0")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0")
        if self.cosched and self.mode != "rollplex":
            raise ValueError("cosched needs mode='rollplex' (it hands shared prefix states to scoring)")
        if self.auto_reprobe_steps < 2 or not 0.0 <= self.auto_margin < 1.0:
            raise ValueError("auto_reprobe_steps must be >= 2 and auto_margin within [0, 1)")
        if not 0.0 < self.fuse_below <= 1.0:
            raise ValueError("fuse_below must be within (0, 1]")
        if self.fuse_chunk_tokens is not None and self.fuse_chunk_tokens < 1:
            raise ValueError("fuse_chunk_tokens must be >= 1 (or None)")
        if self.fuse_sms < 0:
            raise ValueError("fuse_sms must be >= 0 (0: share every SM)")
        parse_sms_by_batch(self.fuse_sms_by_batch)
        _ = self.rollout_corr  # ValueError on a bad rollout-correction option

    @property
    def agg_norm(self) -> float:
        """seq-mean-token-sum-norm's divisor per sequence."""
        return float(self.loss_agg_norm if self.loss_agg_norm is not None else self.max_new_tokens)

    @property
    def policy_loss_params(self) -> PolicyLossParams:
        """The hyperparameters of the sapo / clip_cov / kl_cov losses (validated on construction)."""
        return PolicyLossParams(self.tau_pos, self.tau_neg, self.clip_cov_ratio, self.clip_cov_lb, self.clip_cov_ub,
                                self.kl_cov_ratio, self.ppo_kl_coef)

    @property
    def rollout_corr(self) -> RolloutCorrection:
        """The rollout correction (rl/rollout_correction.py); tis_imp_ratio_cap is its token-level IS weights."""
        if self.tis_imp_ratio_cap is not None:
            return RolloutCorrection("token", self.tis_imp_ratio_cap, self.rollout_is_batch_normalize, self.rollout_rs,
                                     self.rollout_rs_threshold, self.rollout_rs_threshold_lower,
                                     self.rollout_token_veto_threshold)
        return RolloutCorrection(self.rollout_is, self.rollout_is_threshold, self.rollout_is_batch_normalize,
                                 self.rollout_rs, self.rollout_rs_threshold, self.rollout_rs_threshold_lower,
                                 self.rollout_token_veto_threshold)

    @property
    def uses_critic(self) -> bool:
        """PPO with a critic: the step trains a value model."""
        return self.adv_estimator == "gae"

    @property
    def num_updates(self) -> int:
        return self.ppo_epochs * self.ppo_mini_batches

    @property
    def micro_batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_prompts, self.micro_batch_samples, self.micro_batch_max_tokens,
                             self.packed)
