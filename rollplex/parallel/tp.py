"""Tensor parallelism (Megatron style) of the text decoder, applied from outside the model.

`apply_tensor_parallel(model, group)` turns every rank's full model into its TP shard, in place:

    qkv_proj        column-parallel: the rank's query heads and KV heads ([q_t; k_t; v_t]; KV heads
                    replicated when the degree exceeds their count), bias alike
    o_proj          row-parallel over heads -> all-reduce before the residual add
    gate_up_proj    column-parallel: the rank's gate and up features ([gate_t; up_t])
    down_proj       row-parallel -> all-reduce before the residual add
    embed_tokens    vocab-parallel (`VocabParallelEmbedding`: the rank's rows, all-reduce of the lookup)
    lm_head         vocab-parallel; `model.logits` all-gathers the rank's logits into the full vocabulary,
                    `model.local_logits` keeps the rank's rows (engine/vocab_parallel_sampler.py samples from them)
    norms, vision   replicated (the vision tower runs whole on every rank); with `vision=True` the
                    vision blocks are split the same way (qkv and gate_up column-, proj and down
                    row-parallel, their biases added after the all-reduce)

The cut is `rollplex.weights`' rollout layout (`RolloutLayout`, Megatron order), so a TP shard is
exactly the tensor the weight-sharing planner plans for; `shard_state_dict` (rollplex.weights.storage)
is the state-dict adapter (full tensors -> this rank's shards, names unchanged), used here and by whoever
loads or receives full weights into a TP model (broadcast.py, rollplex.rl.checkpoint).

The model's math is untouched: the attention modules get this rank's head counts (the layer function
reads them to split the fused projection), and the decoder's `_post` slot — the function that runs o
projection, residual, norm and MLP, swapped the same way `TextDecoder.compile` swaps it — becomes the
same math with the two all-reduces (eager: a later `model.compile()` compiles the other slots and
keeps this one). The engine's decode layer (engine/decode_forward.py) takes the all-reduce as its
`reduce` hook (`EngineConfig.tensor_parallel`). Every rank ends with the full logits, so sampling
needs no further communication and every rank draws the same tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..models import Qwen25VL
from ..models.layers import rms_norm
from ..weights.storage import shard_state_dict


@dataclass(frozen=True)
class TensorParallel:
    """A TP group and this process's place in it."""

    group: dist.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        group = group or dist.group.WORLD
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

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


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + V/tp) of the embedding table; a lookup sums the ranks' partial results
    (each token's row lives on exactly one rank). `weight` keeps its name: a tied LM head reads it."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.reduce(out.masked_fill(outside[..., None], 0))


def _tp_post_attention(tp: TensorParallel):
    """`models.text._post_attention` over row-parallel o/down shards: each output is all-reduced
    before it joins the residual stream."""

    def post(x, attn, o_w, norm_w, gate_up_w, down_w, eps: float):
        B, H, L, D = attn.shape
        x = x + tp.reduce(F.linear(attn.transpose(1, 2).reshape(B, L, H * D), o_w))
        gate, up = F.linear(rms_norm(x, norm_w, eps), gate_up_w).chunk(2, dim=-1)
        return x, tp.reduce(F.linear(F.silu(gate) * up, down_w))

    return post


def tensor_parallel_copy(model: Qwen25VL, group: dist.ProcessGroup | None = None, vision: bool = False) -> Qwen25VL:
    """This rank's tensor-parallel shard of `model` as a new model beside it. Every parameter the shard
    keeps whole (the norms; the vision tower unless `vision`) is `model`'s own tensor: stored once, kept
    current by whatever updates `model`. The shards (q/k/v, o, gate/up, down, the vocab shards of the
    embedding and LM head; with `vision` the vision blocks' too) are new tensors that own their storage,
    so they are freed once the caller drops `model` (the data-parallel RL step keeps no reference to it)."""
    tp_model = copy.deepcopy(model, {id(p): p for p in model.parameters()})
    apply_tensor_parallel(tp_model, group, vision)
    return tp_model


def apply_tensor_parallel(model: Qwen25VL, group: dist.ProcessGroup | None = None,
                          vision: bool = False) -> TensorParallel:
    """Shard the text decoder of `model` (the same full weights on every rank of `group`) in place, and
    with `vision` the vision tower's blocks (heads and MLP split as in the decoder; patch embed, norms,
    merger and the proj / down biases whole); returns the TP group description. The model then runs
    its usual methods (prefix, forward, the engine's prefill and decode) with collectives inside and
    full logits out."""
    tp = TensorParallel.of(group)
    text, cfg = model.model, model.cfg.text
    if getattr(text, "tensor_parallel", None) is not None:
        raise ValueError("the model is already tensor-parallel")
    names = [n for n, p in model.named_parameters() if vision or not n.startswith("visual.")]
    params = dict(model.named_parameters())
    local = shard_state_dict({n: params[n].detach() for n in names}, model.cfg, tp.size, tp.rank, vision)
    for name, t in local.items():
        if name == "model.embed_tokens.weight" or t.shape == params[name].shape:
            continue  # a replicated parameter (a norm) stays the tensor it is
        mod_name, attr = name.rsplit(".", 1)
        mod = model.get_submodule(mod_name)
        setattr(mod, attr, nn.Parameter(t.clone(), requires_grad=params[name].requires_grad))
    rows = cfg.vocab_size // tp.size
    text.embed_tokens = VocabParallelEmbedding(local["model.embed_tokens.weight"].clone(), tp.rank * rows, tp)
    kv = cfg.num_key_value_heads // tp.size if cfg.num_key_value_heads % tp.size == 0 else 1
    for lyr in text.layers:
        lyr.self_attn.num_heads = cfg.num_attention_heads // tp.size
        lyr.self_attn.num_kv_heads = kv
    post = text._post = _tp_post_attention(tp)

    def compile_keeping_tp(**kwargs):  # a later `model.compile()` fuses the rest, not the collectives away
        type(text).compile(text, **kwargs)
        text._post = post
        return text

    text.compile = compile_keeping_tp
    head = model.logits
    model.logits = lambda hidden: tp.gather_last(head(hidden))
    model.local_logits = head  # this rank's vocabulary rows only (a vocab-parallel sampler's input)
    text.tensor_parallel = tp  # what the engine reads to all-reduce its own decode layer's outputs
    if vision:
        _shard_vision_blocks(model.visual, model.cfg.vision.num_heads, tp)
    return tp


def _tp_vision_post(tp: TensorParallel):
    """`models.vision._post_attention` over row-parallel proj / down shards: each output is all-reduced,
    then its (whole) bias added, before it joins the residual stream."""

    def post(x, attn, proj_w, proj_b, norm_w, gate_up_w, gate_up_b, down_w, down_b):
        x = x + tp.reduce(F.linear(attn.flatten(1), proj_w)) + proj_b
        gate, up = F.linear(rms_norm(x, norm_w, 1e-6), gate_up_w, gate_up_b).chunk(2, dim=-1)
        return x + tp.reduce(F.linear(F.silu(gate) * up, down_w)) + down_b

    return post


def _shard_vision_blocks(vis, num_heads: int, tp: TensorParallel) -> None:
    """The vision tower runs its blocks over this rank's heads and MLP shard: the attention modules get
    the rank's head count, the tower's `_post` slot the reducing math, and the fused whole-block slot is
    off (its graph has no collective); a later `compile()` keeps both."""
    for blk in vis.blocks:
        blk.attn.num_heads = num_heads // tp.size
    post = vis._post = _tp_vision_post(tp)
    vis._whole = None

    def compile_keeping_tp(**kwargs):
        type(vis).compile(vis, **kwargs)
        vis._post, vis._whole = post, None
        return vis

    vis.compile = compile_keeping_tp
    vis.tensor_parallel = tp  # the tower's blocks are sharded (the weight-sharing plan reads it)
