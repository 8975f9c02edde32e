"""Weight broadcast from the trainer to rollout ranks, in buckets.

After each update the trainer's full weights go out from one trainer rank (`src`) over a sync group
that holds it and every rollout rank. Both sides cut the same plan from the model config alone
(`bucket_plan`: the parameters in `named_parameters` order, whole tensors, packed into flat buffers of
at most `bucket_bytes` in the wire dtype; a tensor larger than a bucket travels alone), so no
metadata is exchanged: one `broadcast` per bucket.

    trainer ranks  `send_weights(model, ...)`: every trainer rank calls it (gathering an FSDP shard
                   into the full tensor is a collective over the training mesh); `src` packs and
                   broadcasts
    rollout ranks  `receive_weights(model, ..., tp)`: unpacks each tensor into the model's parameter in
                   place (a tensor-parallel model takes its shard of it, `TPPlan.shard`), so the
                   engine's next step and CUDA graph replay read the new weights with no rebuild

The wire dtype is the rollout's (e.g. bf16 from fp32 trainer masters): the cast happens once, on the
sender. This is the weight sync of the disaggregated layout (disaggregated.py); the colocated layout
shares or rebuilds shards in place instead (`rollplex.weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models import ModelConfig
from ..weights.qwen import param_shapes
from .fsdp import full_tensor
from .tp import TPPlan

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class Bucket:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def bucket_plan(cfg: ModelConfig, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """The buckets both sides use: parameters in model order, each bucket under `bucket_bytes`."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be >= 1")
    size = torch.empty((), dtype=dtype).element_size()
    out: list[tuple[list, list]] = []
    used = 0
    for name, shape in param_shapes(cfg):
        nbytes = math.prod(shape) * size
        if not out or used + nbytes > bucket_bytes:
            out.append(([], []))
            used = 0
        out[-1][0].append(name)
        out[-1][1].append(tuple(shape))
        used += nbytes
    return [Bucket(tuple(n), tuple(s)) for n, s in out]


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def send_weights(model: nn.Module, group: dist.ProcessGroup | None, src: int, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Broadcast `model`'s full weights from global rank `src` over `group`. Call on every rank that
    holds a shard of the model (FSDP DTensors are gathered); ranks other than `src` only gather."""
    params = dict(model.named_parameters())
    dtype = dtype or next(iter(params.values())).dtype
    is_src = dist.get_rank() == src
    for b in bucket_plan(model.cfg, dtype, bucket_bytes):
        full = [full_tensor(params[n].detach()) for n in b.names]
        if is_src:
            flat = torch.cat([t.reshape(-1).to(dtype) for t in full])
            dist.broadcast(flat, src=src, group=group)


@torch.no_grad()
def receive_weights(model: nn.Module, group: dist.ProcessGroup | None, src: int, dtype: torch.dtype,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, tp: TPPlan | None = None) -> None:
    """Receive the weights `send_weights` broadcasts into `model`'s parameters, in place; `dtype` and
    `bucket_bytes` as the sender's. tp: the plan `model` was split by (`apply_tensor_parallel`): it keeps
    its shards; None: the model is whole."""
    params = dict(model.named_parameters())
    dev = _device(model)
    for b in bucket_plan(model.cfg, dtype, bucket_bytes):
        flat = torch.empty(b.numel, dtype=dtype, device=dev)
        dist.broadcast(flat, src=src, group=group)
        full = dict(zip(b.names, (t.view(s) for t, s in zip(flat.split([math.prod(s) for s in b.shapes]),
                                                              b.shapes))))
        if tp is not None:
            full = tp.shard(full, model.cfg)
        for name, t in full.items():
            params[name].copy_(t)
