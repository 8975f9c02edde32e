"""The RL step's memory: the bytes of its regions, the transient bytes of its phases, and the fit.

    step_sizes(step)        bytes per memory tag at steady state (`RLStep.memory_sizes`): the weights the
                            rollout decodes and the trainer shards a data-parallel rank adds to them, the
                            reference, KV cache, gradients, optimizer state and a critic's regions
    fit_step(runtime, ...)  the plan, checkpointing and optimizer offload for the step's device, before
                            its trainer is built (rl/parts.py, `RLStep.memory_fit`; the trainer's share
                            from the step's runtime, rl/runtime.py)
    update_activations      transient bytes per phase: one update micro-batch (the actor's, a critic's), a
                            scoring pass
    fit_memory              `MemoryConfig.fit` (memory/fit.py) for a step of a config on a model

A data-parallel rank's models hold DTensor shards: their bytes are the local shards' (`_local`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from ..memory import TAGS, Footprint, MemoryConfig, MemoryFit, activation_bytes, device_capacity, host_memory
from ..models import ModelConfig, Qwen25VL
from .config import RLConfig


def step_sizes(step, optimizer_offload: str | None = None) -> dict[str, int]:
    """Bytes per memory tag of `step` at steady state; optimizer_offload: the optimizer region's under that
    mode (default: the trainer's)."""
    # a data-parallel rank holds what its engine decodes (the full policy or its TP shard), its
    # shards of the reference, and the trainer's shards that are not windows of the engine's tensors
    trainer = [_local(p.detach()) for p in step.actor.model.parameters()]
    params = [t for t, p in zip(trainer, step.actor.model.parameters()) if p.requires_grad]
    return Footprint(
        weights=_nbytes(step.model.parameters()) + separate_bytes(step.model, step.actor.model),
        ref_weights=ref_bytes(step.ref), kv_cache=step.backend.kv_cache_bytes() if step.backend is not None else 0,
        trainable=sum(p.numel() for p in params), param_bytes=params[0].element_size(),
        **critic_footprint(step.critic.model if step.critic is not None else None),
    ).sizes(optimizer_offload or step.memory_cfg.optimizer_offload)


def critic_footprint(value_model) -> dict[str, int]:
    """The critic's bytes and trainable parameters for `Footprint` (none without a critic)."""
    if value_model is None:
        return {}
    # (a data-parallel rank's, once sharded: its local shards)
    return {"critic_weights": _nbytes(_local(t.detach()) for t in [*value_model.parameters(), *value_model.buffers()]),
            "critic_trainable": sum(_local(p.detach()).numel() for p in value_model.parameters() if p.requires_grad)}


def ref_bytes(ref: Qwen25VL | None) -> int:
    return _nbytes(_local(p.detach()) for p in ref.parameters()) if ref is not None else 0


def fit_step(runtime, backend, cfg: RLConfig, memory, memory_cfg: MemoryConfig, model: Qwen25VL,
             ref: Qwen25VL | None = None, value_model=None) -> MemoryFit:
    """The plan and trainer settings for a step's device (memory/fit.py), before its trainer is built (by
    rl/parts.py, on `runtime` rolling out on `backend` under `memory`): its parameters are `model`'s trainable
    ones (a data-parallel rank's shards: its share of them); ref, value_model: the reference and the critic's
    model, already in their regions."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    n, param_bytes = sum(p.numel() for p in trainable), trainable[0].element_size()
    weights = _nbytes(runtime.policy.parameters())
    # a data-parallel rank's share of the trainer, and its own checkpointing flags as choices given
    n, trainer_bytes, decoder, vision = runtime.trainer_footprint(
        n, param_bytes, cfg.gradient_checkpointing, cfg.vision_gradient_checkpointing)
    weights += trainer_bytes
    footprint = Footprint(weights, ref_bytes(ref), backend.kv_cache_bytes() if backend is not None else 0, n,
                          param_bytes, **critic_footprint(value_model))
    capacity = device_capacity(model.inv_freq.device, memory.backend, memory_cfg.device_capacity_gib)
    if capacity is not None and backend is not None and memory_cfg.device_capacity_gib is None:
        capacity -= backend.device_bytes  # held by the backend's own processes (SGLang's): not the step's
    cfg = replace(cfg, gradient_checkpointing=decoder, vision_gradient_checkpointing=vision)
    # a region's pool keeps the bytes an earlier owner mapped (a trainer dropped for a smaller one)
    mapped = {t: memory.region_bytes(t) for t in TAGS}
    return fit_memory(model.cfg, cfg, memory_cfg, footprint, capacity,
                      host_memory() if model.inv_freq.is_cuda and capacity is not None else None, mapped)


def update_tokens(cfg: RLConfig, prompt_guess: int = 512) -> int:
    """Tokens of one update micro-batch, for the plan: rollplex mode computes each prompt once."""
    mb = cfg.micro_batching
    if mb.max_tokens is not None:
        return mb.max_tokens
    if cfg.mode == "rollplex":
        return mb.prompts * (prompt_guess + cfg.n * cfg.max_new_tokens)
    return mb.samples * (prompt_guess + cfg.max_new_tokens)


def update_activations(model_cfg: ModelConfig, cfg: RLConfig, dtype_bytes: int, checkpointing: bool,
                       logprob_chunk: int = 1024) -> dict[str, int]:
    """Transient bytes per phase for the plan: one micro-batch of the update (the largest by far), and a
    no-grad scoring pass of the same tokens in `ref` (one layer's intermediates at a time). Both add the
    chunked logprob pass (rl/logprob.py): a [chunk, V] block of logits and their fp32 softmax; the
    update also the head's fp32 gradient accumulator [V, H]. A critic (PPO-GAE) trains on the same
    micro-batches in `update_critic`: the backbone's activations, and a scalar head instead of logits."""
    t, tokens = model_cfg.text, update_tokens(cfg)
    chunk = min(tokens, logprob_chunk) * t.vocab_size * (dtype_bytes + 8)
    backbone = activation_bytes(t.hidden_size, t.num_hidden_layers, tokens, dtype_bytes, checkpointing,
                                t.intermediate_size)
    update = backbone + chunk + 4 * t.vocab_size * t.hidden_size
    ref = activation_bytes(t.hidden_size, 1, tokens, dtype_bytes, False, t.intermediate_size) + chunk
    return {"rollout": 0, "ref": ref, "update": update, "update_critic": backbone if cfg.uses_critic else 0}


def fit_memory(model_cfg: ModelConfig, cfg: RLConfig, memory_cfg: MemoryConfig, footprint: Footprint,
               capacity: int | None, host_capacity: int | None = None,
               mapped: dict[str, int] | None = None) -> MemoryFit:
    """`memory_cfg.fit` for an RL step of `cfg` on a model of `model_cfg` with `footprint`'s regions: the
    plan, checkpointing and optimizer offload that fit `capacity` bytes (None: unchecked). cfg's
    checkpointing flags and memory_cfg's optimizer_offload as the user gave them (None / auto: the plan's);
    host_capacity: bytes of host RAM the pinned offloads must fit (None: unchecked); mapped: bytes per tag the
    regions already map, each region planned at least at them."""
    floor = mapped or {}

    def estimate(checkpointing: bool, optimizer_offload: str):
        sizes = {t: max(n, floor.get(t, 0)) for t, n in footprint.sizes(optimizer_offload).items()}
        return sizes, update_activations(model_cfg, cfg, footprint.param_bytes, checkpointing)

    detail = (f"{update_tokens(cfg)} tokens per update micro-batch: micro_batch_prompts={cfg.micro_batch_prompts}, "
              f"micro_batch_max_tokens={cfg.micro_batch_max_tokens}, n={cfg.n}, max_new_tokens={cfg.max_new_tokens}")
    return memory_cfg.fit(estimate, capacity, cfg.gradient_checkpointing, cfg.vision_gradient_checkpointing, detail,
                          host_capacity)


def separate_bytes(policy: torch.nn.Module, trainer: torch.nn.Module) -> int:
    """Bytes of the storages of the trainer's parameters (its local shards, with FSDP2's padding) that are not
    those of the weights the rollout decodes (`policy`): nothing when it trains them, a data-parallel trainer's
    shards that are not windows of them."""
    decoded = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    own = {}
    for p in trainer.parameters():
        storage = _local(p.detach()).untyped_storage()
        if storage.data_ptr() not in decoded:
            own[storage.data_ptr()] = storage.nbytes()
    return sum(own.values())


def local_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors `model` holds on this process (a sharded model's local shards): what its memory region keeps."""
    return [_local(t.detach()) for t in (*model.parameters(), *model.buffers())]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
