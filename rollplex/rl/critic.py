"""PPO's critic (`adv_estimator="gae"`): a value model and its trainer.

The value model is the policy's architecture without its LM head — the Qwen2.5-VL backbone — plus a
scalar head `score` (hidden -> 1, with a bias), as verl's critic is an AutoModelForTokenClassification
with num_labels=1. It wraps a `Qwen25VL` (the model class knows nothing of critics) and reads the
backbone's final-normed hidden states through the same path as the actor's logprobs
(`scoring.response_hidden`): the value of response token t is the head applied to the hidden state
*predicting* token t, i.e. at the position before it (verl: values = logits[:, -R-1:-1]). So the modes
work as they do for the actor:

    rollplex: each prompt (vision tower + prompt tokens) computed once per micro-batch, its n responses
              attending to it (packed, or a prefix pass then the padded responses); the backward
              of the value loss flows through the one shared prefix graph
    serial:   every sample a full sequence, its image re-encoded (verl's order)

The critic never reuses the rollout's vision encodings or co-scheduled prefix states (they are the
actor's / reference's): its vision tower runs once per prompt per pass in rollplex mode.

Initialisation (`build_value_model`): a copy of the policy's weights with a fresh head (normal(0, 0.02)
weight, zero bias, seeded), or an HF directory (`critic_model_path`): its backbone tensors read with
rollplex's checkpoint adapter (an `lm_head` in it is ignored), its head from `score.weight` / `score.bias`
when present, else fresh. `save_value_model` writes such a directory (the backbone in HF names plus
`score.*`, no LM head). The vocabulary must be the policy's (the critic reads the same token ids).

The trainer (`Critic`) is a Trainer as the actor is (rl/trainer.py: the same mini-batches and epochs,
the OOM ladder, the agreed optimizer step), whose mini-batch is verl's clipped value loss (rl/algos.py
`value_loss`) against the returns of GAE, clipped around the values scored before the update; AdamW over
fp32 masters in the `critic_optimizer` / `critic_grads` memory regions, the actor's `grad_clip`, and the
lr `critic_lr` (a step's config may override it) times the actor's schedule shape with the critic's own
warm-up (`critic_lr_warmup_steps`), at the step's index: once per step, as verl's critic scheduler, and
nothing to checkpoint beyond the step count. Metrics use verl's names: critic/vf_loss,
critic/vf_clipfrac, critic/vpred_mean, critic/grad_norm, critic/lr (and, from the step,
critic/values/*, critic/returns/*, critic/vf_explained_var).

Out of memory in the critic's passes backs off as the actor's do: the values' scoring and the update's
forward/backward retry the pass with halved micro-batches (kept for later steps, one back-off for
scoring and one for training), the update then with activation checkpointing, and at one prompt (one
sequence) per pass raise TrainOOM — before the mini-batch's optimizer step, so a failed mini-batch
changes nothing. The optimizer step is the actor's (rl/trainer.py): agreed over a data-parallel
placement's ranks, and any failure after one says what was applied. Not like the actor: no entropy/KL
terms.

The passes run over a placement (rl/placement.py), as the actor's: this process, or a data-parallel
group (`rollplex.parallel.DataParallelCritic`: the value model sharded by FSDP2, each rank scoring and
training its share of the prompt groups, losses divided by the whole mini-batch's normaliser and the
gradients summed over the ranks), so the data-parallel critic computes what one process does.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn as nn

from ..models import ModelConfig, Qwen25VL, hf_to_rollplex, save_model
from ..models.checkpoint import empty_model, read_safetensors
from ..models.transfer import to_device
from .actor import _rows
from .algos import agg_denominator, value_loss
from .batch import RolloutBatch
from .config import RLConfig
from .errors import is_oom
from .optimizer import MasterAdamW
from .placement import Placement, SingleProcess
from .scoring import response_hidden
from .trainer import Trainer, lr_lambda, retry_oom

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


class Critic(Trainer):
    score_hints = (CRITIC_DP_HINT, CRITIC_HINT)

    def __init__(self, model: ValueModel, cfg: RLConfig, memory=None, optimizer_offload: str = "none",
                 placement: Placement | None = None):
        """placement: where the passes run (default: this process; `rollplex.parallel.DataParallelCritic`
        gives a data-parallel one over an FSDP2-sharded value model, as for the actor)."""
        self.cfg = cfg
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = MasterAdamW(params, memory=memory, offload=optimizer_offload,
                                regions=("critic_optimizer", "critic_grads"), lr=cfg.critic_lr,
                                betas=cfg.betas, weight_decay=cfg.weight_decay)
        super().__init__(model, optimizer, placement or SingleProcess(), memory, role="critic")
        self.placement.set_checkpointing(model, bool(cfg.gradient_checkpointing),
                                         bool(cfg.vision_gradient_checkpointing))
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

    def update(self, batch: RolloutBatch, returns: torch.Tensor, old_values: torch.Tensor, step: int = 0,
               cfg: RLConfig | None = None, nonfinite: str = "skip") -> dict:
        """Train on the GAE returns [N, R] with the values scored before the update `old_values` [N, R];
        returns the metrics averaged over the mini-batches. A mini-batch with a non-finite loss or
        gradient norm is skipped (`critic/skipped_updates`) or raises NonFiniteUpdate (`nonfinite="raise"`).
        Under a data-parallel placement every rank calls it with the same arguments and gets the same
        results (metrics summed and the gradients' norm taken over the ranks: every rank skips alike)."""
        cfg = cfg or self.cfg
        batch = self._own_view(batch)
        self.model.train()

        def minibatch(epoch: int, done: int, mini: RolloutBatch, mini_idx: torch.Tensor) -> dict:
            stats = retry_oom(lambda plan: self._minibatch(cfg, plan, mini, mini_idx, returns, old_values),
                              cfg.micro_batching, cfg.mode, self.train_backoff, self.placement, self.model,
                              "the critic's update", (CRITIC_DP_HINT, CRITIC_HINT), self.applied, self.recover,
                              checkpointing=True)
            stats["critic/lr"] = self._set_lr(cfg, step)
            return stats

        self.applied = 0
        try:  # the optimizer step is agreed over a data-parallel placement's ranks, as the actor's
            return self.fit(cfg, batch, step, minibatch, nonfinite)
        except BaseException as e:
            raise self.failure(e, self.applied)  # noqa: B904 - the error itself, or one caused by it
        finally:
            self.optimizer.zero_grad(set_to_none=self.memory is None)
            self.model.eval()

    def _minibatch(self, cfg: RLConfig, plan, mini: RolloutBatch, mini_idx: torch.Tensor, returns: torch.Tensor,
                   old_values: torch.Tensor) -> dict:
        """Forward/backward of this process's share of one mini-batch's micro-batches into zeroed gradients,
        each loss divided by the whole mini-batch's normaliser, then clipped on the global norm: its metrics
        (summed over the placement's processes). Rows of a pass past its sample indices are a placement's
        masked-out dummies."""
        model, pl = self.model, self.placement
        self.optimizer.zero_grad()
        denom = agg_denominator(mini.mask, cfg.loss_agg_mode, cfg.agg_norm)
        n_tok = max(float(mini.mask.sum()), 1.0)
        dev = model.inv_freq.device
        acc = torch.zeros(len(METRICS), device=dev)
        local, local_idx = pl.share(mini, cfg.mode)
        for mb, idx in pl.passes(local, cfg.mode, plan):
            try:
                n_all = mb.num_samples
                gidx = mini_idx[local_idx[idx]]  # the real samples' indices in the whole batch
                v = pl.run(model, model.values, mb, cfg.mode, plan.packed)
                mask = to_device(mb.mask, dev)
                loss, clipfrac = value_loss(v, to_device(_rows(old_values, gidx, n_all), dev),
                                            to_device(_rows(returns, gidx, n_all), dev), mask, cfg.cliprange_value,
                                            cfg.loss_agg_mode, denom, cfg.agg_norm)
                loss.backward()
                w = float(mb.mask.sum()) / n_tok  # token share of this micro-batch, for the token means
                acc += torch.stack([loss.detach(), clipfrac.detach() * w, (v.detach() * mask).sum() / n_tok])
            except Exception as err:  # noqa: BLE001 - only OOM is deferred
                if not (is_oom(err) and pl.defer_oom()):
                    raise
                break  # this rank's part of the mini-batch is lost: `end_passes` backs every rank off
        pl.end_passes(model, lambda mb: model.values(mb, cfg.mode, plan.packed))
        stats = dict(zip(METRICS, pl.sum_(acc).tolist()))
        stats["critic/grad_norm"] = float(pl.clip_grad_norm_(self.optimizer.touched_params(), cfg.grad_clip))
        return stats

    def _set_lr(self, cfg: RLConfig, step: int) -> float:
        """The critic's lr at train step `step`, set on its optimizer."""
        lr = cfg.critic_lr * lr_lambda(replace(cfg, warmup_steps=cfg.critic_lr_warmup_steps))(step)
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
