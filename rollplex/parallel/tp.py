"""Tensor parallelism (Megatron style) of the text decoder, applied from outside the model.

`apply_tensor_parallel(model, group)` replaces the parameters of every rank's full model by its TP shard,
in place, and returns what it did as a `TPPlan`, which whoever runs, loads or syncs the model is given:

    qkv_proj        column-parallel: the rank's query heads and KV heads ([q_t; k_t; v_t]; KV heads
                    replicated when the degree exceeds their count), bias alike
    o_proj          row-parallel over heads -> all-reduce before the residual add
    gate_up_proj    column-parallel: the rank's gate and up features ([gate_t; up_t])
    down_proj       row-parallel -> all-reduce before the residual add
    embed_tokens    vocab-parallel: the rank's rows; a lookup sums the ranks' partial results
    lm_head         vocab-parallel; `plan.logits` all-gathers the rank's logits into the full vocabulary,
                    `model.logits` gives the rank's rows (engine/vocab_parallel_sampler.py samples from them)
    norms, vision   replicated (the vision tower runs whole on every rank); with `vision=True` the
                    vision blocks are split the same way (qkv and gate_up column-, proj and down
                    row-parallel, their biases added after the all-reduce)

The cut is `rollplex.weights`' rollout layout (`RolloutLayout`, Megatron order), so a TP shard is
exactly the tensor the weight-sharing planner plans for; `shard_state_dict` (rollplex.weights.storage)
is the state-dict adapter (full tensors -> this rank's shards, names unchanged), used here and by whoever
loads or receives full weights into a TP model (`TPPlan.shard`: broadcast.py, rollplex.rl.run_state).

Only parameters change: the model object keeps its modules, attributes and methods, and knows nothing
of the split. Its attention modules read their head counts off the weights they hold, and what differs
in the forward — the vocab-parallel lookup and the decoder's (and with `vision` the vision blocks')
post-attention function with the two all-reduces — is `plan.ops` (models.ops.ForwardOps), which the
caller passes to the model's inference paths (`embed_prompts`, `forward_embeds`, `hidden`, `embed`);
`plan.hidden` / `plan.forward` are those paths with the plan's ops. These functions stay eager (a
later `model.compile()` compiles the model's own slots only; they are not among them). The engine
takes the plan (`Engine(model, ..., tp=plan)`): its prefill runs the model with `plan.ops`, its decode
layer (engine/decode_forward.py) takes `plan.reduce` as its `reduce` hook. Every rank ends with the full
logits, so sampling needs no further communication and every rank draws the same tokens.

DTensor's `parallelize_module` is not used: the fused q/k/v and gate/up cut (rank-interleaved rows,
replicated KV heads) is not a DTensor placement of the stored tensors, and the engine's fused decode
(paged-attention and split-K kernels, CUDA graphs) runs on the plain local tensors; the shard layout
stays `rollplex.weights`', which weight sharing plans with.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..models import ForwardOps, ModelConfig, ModelInputs, Qwen25VL
from ..models.layers import rms_norm
from ..weights.storage import shard_state_dict


@dataclass(frozen=True)
class TPConfig:
    """The tensor parallelism an entry point asks for (the server's `--tensor-parallel`); the builder turns
    it into a `TPPlan` by applying it (`tensor_parallel_copy` over the engine's group)."""

    tensor_parallel: int = 1  # ranks per rollout engine, each holding its shard of the policy (1: off)
    # the vision tower's blocks split over the engine's ranks too; False: the tower runs whole on every rank
    tensor_parallel_vision: bool = False

    def __post_init__(self):
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel_vision and self.tensor_parallel == 1:
            raise ValueError("tensor_parallel_vision needs tensor_parallel > 1")


@dataclass(frozen=True)
class TPPlan:
    """What `apply_tensor_parallel` did to a model: its group and this process's place in it, whether the
    vision blocks are split too, and the functions that run the shards together (`ops`, `reduce`,
    `logits`). Immutable; the model holds none of it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    vision: bool = False
    ops: ForwardOps = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "ops", ForwardOps(_vocab_parallel_embed(self), _tp_post_attention(self),
                                                   _tp_vision_post(self) if self.vision else None,
                                                   reduce=self.reduce))

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None, vision: bool = False) -> TPPlan:
        group = group or dist.group.WORLD
        return cls(group, dist.get_world_size(group), dist.get_rank(group), vision)

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs of a row-parallel projection (in place)."""
        dist.all_reduce(t, group=self.group)
        return t

    def gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """The ranks' equal slices of the last dim, concatenated in rank order."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=-1)

    def logits(self, model: Qwen25VL, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of the sharded `model` (its `logits` gives this rank's rows)."""
        return self.gather_last(model.logits(hidden))

    def hidden(self, model: Qwen25VL, prompts: Sequence[ModelInputs]) -> torch.Tensor:
        """`model.hidden` of the sharded model (every rank the same prompts)."""
        return model.hidden(prompts, self.ops)

    def forward(self, model: Qwen25VL, prompts: Sequence[ModelInputs]) -> torch.Tensor:
        """`model(prompts)` of the sharded model: full logits [B, Lmax, V] on every rank."""
        return self.logits(model, self.hidden(model, prompts))

    def shard(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """Full tensors {name: tensor} -> this rank's shards of them (`shard_state_dict`, names unchanged)."""
        return shard_state_dict(state, cfg, self.size, self.rank, self.vision)


def _vocab_parallel_embed(tp: TPPlan):
    """The lookup in this rank's rows [start, start + V/tp) of the embedding table: each token's row lives
    on exactly one rank, so the ranks' partial results sum to the whole lookup."""

    def embed(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - tp.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)
        return tp.reduce(out.masked_fill(outside[..., None], 0))

    return embed


def _tp_post_attention(tp: TPPlan):
    """`models.text._post_attention` over row-parallel o/down shards: each output is all-reduced
    before it joins the residual stream."""

    def post(x, attn, o_w, norm_w, gate_up_w, down_w, eps: float):
        B, H, L, D = attn.shape
        x = x + tp.reduce(F.linear(attn.transpose(1, 2).reshape(B, L, H * D), o_w))
        gate, up = F.linear(rms_norm(x, norm_w, eps), gate_up_w).chunk(2, dim=-1)
        return x, tp.reduce(F.linear(F.silu(gate) * up, down_w))

    return post


def _tp_vision_post(tp: TPPlan):
    """`models.vision._post_attention` over row-parallel proj / down shards: each output is all-reduced,
    then its (whole) bias added, before it joins the residual stream."""

    def post(x, attn, proj_w, proj_b, norm_w, gate_up_w, gate_up_b, down_w, down_b):
        x = x + tp.reduce(F.linear(attn.flatten(1), proj_w)) + proj_b
        gate, up = F.linear(rms_norm(x, norm_w, 1e-6), gate_up_w, gate_up_b).chunk(2, dim=-1)
        return x + tp.reduce(F.linear(F.silu(gate) * up, down_w)) + down_b

    return post


def tensor_parallel_copy(model: Qwen25VL, group: dist.ProcessGroup | None = None,
                         vision: bool = False) -> tuple[Qwen25VL, TPPlan]:
    """(this rank's tensor-parallel shard of `model` as a new model beside it, its plan). Every parameter
    the shard keeps whole (the norms; the vision tower unless `vision`) is `model`'s own tensor: stored
    once, kept current by whatever updates `model`. The shards (q/k/v, o, gate/up, down, the vocab shards
    of the embedding and LM head; with `vision` the vision blocks' too) are new tensors that own their
    storage, so they are freed once the caller drops `model` (the data-parallel RL step keeps no reference
    to it)."""
    tp_model = copy.deepcopy(model, {id(p): p for p in model.parameters()})
    return tp_model, apply_tensor_parallel(tp_model, group, vision)


def apply_tensor_parallel(model: Qwen25VL, group: dist.ProcessGroup | None = None,
                          vision: bool = False) -> TPPlan:
    """Replace the text decoder's parameters of `model` (the same full weights on every rank of `group`)
    by this rank's shards, in place, and with `vision` the vision blocks' (heads and MLP split as in the
    decoder; patch embed, norms, merger and the proj / down biases whole); returns the plan that runs
    them (module docstring). Nothing but parameters changes: a model that is already a shard (its LM
    head holds fewer rows than the vocabulary) is refused."""
    tp = TPPlan.of(group, vision)
    cfg = model.cfg.text
    if model.head_weight.shape[0] != cfg.vocab_size:
        raise ValueError("the model is already tensor-parallel (its LM head holds a share of the vocabulary)")
    names = [n for n, p in model.named_parameters() if vision or not n.startswith("visual.")]
    params = dict(model.named_parameters())
    local = tp.shard({n: params[n].detach() for n in names}, model.cfg)
    for name, t in local.items():
        if t.shape == params[name].shape:
            continue  # a replicated parameter (a norm) stays the tensor it is
        mod_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(t.clone(), requires_grad=params[name].requires_grad))
    return tp
