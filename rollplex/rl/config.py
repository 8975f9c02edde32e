"""Configuration of the RL step (one dataclass, verl's names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass

from .algos import AGG_MODES, KL_KINDS
from .microbatch import MicroBatching

MODES = ("rollplex", "serial")
ADV_ESTIMATORS = ("grpo",)
LR_SCHEDULES = ("constant", "cosine")


@dataclass
class RLConfig:
    mode: str = "rollplex"  # rollplex: shared-prefix scoring/training; serial: verl's per-sample order
    # rollout
    n: int = 8  # samples per prompt (GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    # algorithm
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip: float | None = None  # verl's clip_ratio_c (e.g. 3.0); None disables
    loss_agg_mode: str = "token-mean"
    kl_coef: float = 0.0
    use_kl_loss: bool = True  # True: KL term in the loss (GRPO); False: KL penalty in the reward
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    # optimisation
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    total_steps: int = 1000  # for the cosine schedule
    ppo_epochs: int = 1
    ppo_mini_batches: int = 1  # mini-batches per rollout (each is one optimizer step)
    # micro-batches (`micro_batching`, microbatch.py): what one forward/backward of scoring or the update holds
    micro_batch_prompts: int = 4  # prompts per forward/backward (all their samples together)
    micro_batch_samples: int = 8  # serial mode: sequences per forward/backward
    # token budget per forward/backward (verl: use_dynamic_bsz + ppo_max_token_len_per_gpu): when set, a
    # micro-batch takes prompts with all their samples (rollplex) or sequences (serial), in order, while
    # their tokens fit, at least one; it replaces the two counts above. Tokens are what the pass
    # computes: rollplex counts each prompt once, serial counts it per sequence.
    micro_batch_max_tokens: int | None = None
    # rollplex mode: True packs a micro-batch's prompts and responses into one sequence (one pass, no
    # padding, one varlen attention call per layer); False runs a prefix pass, then the padded
    # responses over its PrefixState. Same values (tests hold both to the serial mode). Packed is the
    # default because it is faster and needs about half the memory of the padded responses, which is
    # what lets 4 prompts x 8 samples fit a micro-batch on one GPU (docs/BENCHMARKS.md).
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
    # hand the prefix states to scoring; same values as without it
    cosched: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError("only adv_estimator='grpo' is implemented")
        if self.loss_agg_mode not in AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}")
        if self.kl_loss_type not in KL_KINDS:
            raise ValueError(f"kl_loss_type must be one of {KL_KINDS}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError("lr_schedule must be 'constant' or 'cosine'")
        for name in ("n", "max_new_tokens", "ppo_epochs", "ppo_mini_batches", "micro_batch_prompts",
                     "micro_batch_samples", "total_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.micro_batch_max_tokens is not None and self.micro_batch_max_tokens < 1:
            raise ValueError("micro_batch_max_tokens must be >= 1 (or None)")
        if self.temperature <= 0:
            raise ValueError("RL rollouts need temperature > 0")
        if self.lr <= 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0")
        if self.cosched and self.mode != "rollplex":
            raise ValueError("cosched needs mode='rollplex' (it hands shared prefix states to scoring)")

    @property
    def num_updates(self) -> int:
        return self.ppo_epochs * self.ppo_mini_batches

    @property
    def micro_batching(self) -> MicroBatching:
        return MicroBatching(self.micro_batch_prompts, self.micro_batch_samples, self.micro_batch_max_tokens,
                             self.packed)
