"""PPO's critic (`adv_estimator="gae"`): a `ValueModel`, its `ValueLoss`, and the Trainer of both.

`ValueModel` is the policy's backbone without its LM head plus a scalar head `score` (verl's critic: an
AutoModelForTokenClassification with num_labels=1); the value of response token t is the head on the
hidden state predicting it, read through the actor's path (`scoring.response_hidden`), so `rollplex`
mode computes each prompt once and `serial` mode every sample in full. `build_value_model` copies the
policy with a fresh, seeded head or reads an HF directory (`critic_model_path`); `save_value_model`
writes one back. The critic never reuses the rollout's vision encodings or prefix states (the policy's).

`ValueLoss` is verl's clipped value loss (rl/algos.py `value_loss`) against GAE's returns, clipped
around the values scored before the update. `Critic` trains it as the actor trains its loss (rl/trainer.py:
the same mini-batches, OOM ladder, agreed optimizer step), with AdamW over fp32 masters in the
`critic_optimizer` / `critic_grads` regions and the lr `critic_lr` times the actor's schedule shape with
its own warm-up, at the step's index. Metrics use verl's names (critic/vf_loss, critic/vf_clipfrac,
critic/vpred_mean, critic/grad_norm, critic/lr). A data-parallel critic (`rollplex.parallel.
DataParallelCritic`) is the same over FSDP2 shards. More in docs/ARCHITECTURE.md ("The trainers").
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from ..models import ModelConfig, Qwen25VL, hf_to_rollplex, save_model
from ..models.hf_io import empty_model, read_safetensors
from ..models.transfer import to_device
from .activation_checkpointing import set_activation_checkpointing
from .actor import _rows
from .algos import agg_denominator, value_loss
from .batch import RolloutBatch
from .config import RLConfig
from .optimizer import MasterAdamW
from .placement import Placement
from .scoring import response_hidden
from .trainer import Trainer, lr_lambda

# what to change when the critic runs out of memory: inside a data-parallel pass; at the smallest micro-batch
CRITIC_DP_HINT = "lower micro_batch_prompts or turn on gradient_checkpointing"
CRITIC_HINT = "lower n or max_new_tokens, or offload the critic (memory plan)"

HEAD = ("score.weight", "score.bias")  # AutoModelForTokenClassification's names
METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


class ValueModel(nn.Module):
    """A Qwen2.5-VL backbone (its LM head dropped) and a scalar value head."""

    def __init__(self, backbone: Qwen25VL, seed: int = 0, std: float = 0.02):
        super().__init__()
        backbone.lm_head = None  # the critic computes no logits: no [V, H] matrix to keep or train
        self.backbone = backbone
        p = next(backbone.parameters())
        self.score = nn.Linear(backbone.cfg.text.hidden_size, 1, device=p.device, dtype=p.dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(self.score.weight.shape, generator=g) * std)
            self.score.bias.zero_()

    @property
    def cfg(self) -> ModelConfig:
        return self.backbone.cfg

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.backbone.inv_freq

    @property
    def model(self) -> nn.Module:
        """The backbone's decoder, and below its vision tower: what activation checkpointing and a data-parallel
        placement's sharding (parallel/fsdp.py `apply_fsdp`) address on a Qwen25VL."""
        return self.backbone.model

    @property
    def visual(self) -> nn.Module:
        return self.backbone.visual

    def values(self, mb: RolloutBatch, mode: str, packed: bool) -> torch.Tensor:
        """V of each response token [n, R] (fp32): the head on the hidden state before that token."""
        hidden = response_hidden(self.backbone, mb, mode, packed)
        return self.score(hidden).squeeze(-1).float()


def build_value_model(policy: Qwen25VL, path: str | Path | None = None, seed: int = 0) -> ValueModel:
    """The critic for `policy`: a copy of its weights (path None) or the HF directory `path`, in the
    policy's device and dtype; a head missing from the directory is initialised. ValueError for a
    directory that is not a checkpoint of a model with the policy's vocabulary."""
    if path is None:
        return ValueModel(copy.deepcopy(policy), seed)
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"critic_model_path {str(path)!r} is not an HF checkpoint directory (no config.json)")
    cfg = ModelConfig.from_hf(str(path))
    if cfg.text.vocab_size != policy.cfg.text.vocab_size:
        raise ValueError(f"the critic at {path} has a vocabulary of {cfg.text.vocab_size} tokens, the policy "
                         f"{policy.cfg.text.vocab_size}")
    p = next(policy.parameters())
    hf = read_safetensors(path)
    head = {k: hf.pop(k) for k in HEAD if k in hf}
    state = hf_to_rollplex(hf, cfg)
    state.pop("lm_head.weight", None)
    vm = ValueModel(empty_model(cfg, p.device, p.dtype), seed)
    own = vm.backbone.state_dict()
    missing, unknown = set(own) - set(state), set(state) - set(own)
    if missing or unknown:
        raise ValueError(f"the critic at {path} does not match its config: "
                         + (f"lacks {sorted(missing)[:3]}" if missing else f"has unknown {sorted(unknown)[:3]}"))
    wrong = [k for k, v in own.items() if state[k].shape != v.shape]
    if wrong or any(head[k].shape != getattr(vm.score, k.split(".")[1]).shape for k in head):
        raise ValueError(f"the critic at {path} has other shapes for {(wrong or list(head))[:3]}")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])
        for k, t in head.items():
            getattr(vm.score, k.split(".")[1]).copy_(t)
    return vm


def value_state(vm: ValueModel) -> dict[str, torch.Tensor]:
    """The critic's tensors by their checkpoint names (the backbone's, then `score.*`)."""
    return {**vm.backbone.state_dict(), "score.weight": vm.score.weight, "score.bias": vm.score.bias}


def save_value_model(vm: ValueModel, path: str | Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    """An HF directory `build_value_model` reads back (the backbone in HF names, the head as `score.*`);
    state: the whole tensors by `value_state`'s names (a sharded critic's, gathered), default its own."""
    return save_model(vm.backbone, path, state=state or value_state(vm))


def token_values(model: ValueModel, mb: RolloutBatch, mode: str, packed: bool,
                 prefix_key: str | None = None) -> torch.Tensor:
    """The forward `Trainer.score` runs to score values: V of each response token [n, R]."""
    return model.values(mb, mode, packed)


class ValueLoss:
    """verl's clipped value loss (rl/algos.py `value_loss`) of one update's passes (a `Loss`, rl/trainer.py):
    the values against the GAE `returns` [N, R], clipped around the values scored before the update
    `old_values` [N, R]."""

    metrics = METRICS

    def __init__(self, cfg: RLConfig, returns: torch.Tensor, old_values: torch.Tensor):
        self.cfg, self.returns, self.old_values = cfg, returns, old_values

    def start(self) -> None:
        pass

    def norms(self, mask: torch.Tensor) -> tuple[float, float]:
        """(loss denominator, tokens) of a mini-batch with response mask `mask`."""
        return agg_denominator(mask, self.cfg.loss_agg_mode, self.cfg.agg_norm), max(float(mask.sum()), 1.0)

    def forward(self, model: ValueModel, mb: RolloutBatch, mode: str, packed: bool) -> torch.Tensor:
        return model.values(mb, mode, packed)

    def __call__(self, v: torch.Tensor, mb: RolloutBatch, gidx: torch.Tensor,
                 norms: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, (denom, n_tok), n_all, dev = self.cfg, norms, mb.num_samples, v.device
        mask = to_device(mb.mask, dev)
        loss, clipfrac = value_loss(v, to_device(_rows(self.old_values, gidx, n_all), dev),
                                    to_device(_rows(self.returns, gidx, n_all), dev), mask, cfg.cliprange_value,
                                    cfg.loss_agg_mode, denom, cfg.agg_norm)
        w = float(mb.mask.sum()) / n_tok  # token share of this micro-batch, for the token means
        return loss, torch.stack([loss.detach(), clipfrac.detach() * w, (v.detach() * mask).sum() / n_tok])


class Critic(Trainer):
    score_hints = train_hints = (CRITIC_DP_HINT, CRITIC_HINT)
    update_name = "the critic's update"

    def __init__(self, model: ValueModel, cfg: RLConfig, memory=None, optimizer_offload: str = "none",
                 placement: Placement | None = None):
        """placement: where the passes run (default: this process; `rollplex.parallel.Colocated.place`
        gives a data-parallel one over an FSDP2-sharded value model, as for the actor)."""
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = MasterAdamW(params, memory=memory, offload=optimizer_offload,
                                regions=("critic_optimizer", "critic_grads"), lr=cfg.critic_lr,
                                betas=cfg.betas, weight_decay=cfg.weight_decay)
        super().__init__(model, optimizer, placement, memory, role="critic")
        set_activation_checkpointing(model, bool(cfg.gradient_checkpointing), bool(cfg.vision_gradient_checkpointing))
        model.eval()

    @staticmethod
    def _own_view(batch: RolloutBatch) -> RolloutBatch:
        """The batch without the rollout's vision encodings and prefix states (the policy's, not the critic's)."""
        prompts = [p if p.vision_embeds is None else replace(p, vision_embeds=None) for p in batch.prompts]
        return replace(batch, prompts=prompts, prefix={})

    def values(self, batch: RolloutBatch, cfg: RLConfig | None = None) -> torch.Tensor:
        """The critic's values [N, R] (fp32, host) of the batch's responses, zero on padding (`Trainer.score`:
        under a data-parallel placement each rank scores its share and every rank gets the whole [N, R])."""
        return self.score(self._own_view(batch), token_values, cfg or self.cfg, what="scoring the critic's values")

    def update(self, batch: RolloutBatch, returns: torch.Tensor, old_values: torch.Tensor, step_idx: int = 0,
               cfg: RLConfig | None = None, nonfinite: str = "skip") -> dict:
        """`Trainer.fit` of the `ValueLoss` on the GAE returns [N, R] with the values scored before the update
        `old_values` [N, R]; returns the metrics averaged over the mini-batches. A mini-batch with a non-finite
        loss or gradient norm is skipped (`critic/skipped_updates`) or raises NonFiniteUpdate
        (`nonfinite="raise"`). Under a data-parallel placement every rank calls it with the same arguments and
        gets the same results (metrics summed and the gradients' norm taken over the ranks: every rank skips
        alike); the optimizer step is agreed over the ranks, as the actor's."""
        cfg = cfg or self.cfg
        loss = ValueLoss(cfg, returns, old_values)
        return self.fit(cfg, self._own_view(batch), step_idx,
                        lambda epoch, done, mini, mini_idx: self.train_minibatch(cfg, mini, mini_idx, loss, step_idx),
                        nonfinite)

    def set_lr(self, cfg: RLConfig, step_idx: int) -> float:
        """The critic's lr at train step `step_idx`, set on its optimizer."""
        lr = cfg.critic_lr * lr_lambda(replace(cfg, warmup_steps=cfg.critic_lr_warmup_steps))(step_idx)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def state_dict(self, masters: bool = True) -> dict:
        return {"optimizer": self.optimizer.state_dict(masters)}

    def check_state_dict(self, sd) -> None:
        if not isinstance(sd, dict) or "optimizer" not in sd:
            raise ValueError("the critic state has no optimizer state")
        self.optimizer.check_state_dict(sd["optimizer"])

    def load_state_dict(self, sd: dict, weights_dtype: torch.dtype | None = None) -> int:
        return self.optimizer.load_state_dict(sd["optimizer"], weights_dtype)
