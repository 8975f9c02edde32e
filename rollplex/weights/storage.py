"""Tensors for a plan: allocate shared storage, cut shards, rebuild rollout tensors.

`shard_state_dict` cuts a whole state dict into one tensor-parallel rank's rollout shards (the tensors a
tensor-parallel model holds): how full weights are loaded or received into such a model.

`allocate` gives one rank's tensors for one parameter: with a `Share`, a single buffer of which the
padded training tensor and the rollout tensor are two windows (so the shared elements exist once and
an optimizer step on the training shard is visible to the engine at once); without, two separate
tensors. The trainer must adopt `train` as the FSDP2 shard's storage (padding included), the engine
`rollout` as its weight, viewed to the TP shard's shape (`Region.rows` x `width`, 1-D for 1-D
parameters).

`rebuild_local` fills the rebuilt blocks when every rank's training tensor is in this process
(tests, world size 1); `rebuild` does it across processes: for every peer, the blocks it needs from
this rank are packed into one buffer and exchanged with batched isend/irecv, then unpacked into the
rollout tensors (NCCL on GPUs, gloo on CPU). Either way the buffers are reused: call it after each
optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .layout import RolloutLayout
from .planner import ModelPlan
from .qwen import model_specs
from .regions import Region
from .share import Copy, ParamPlan

if TYPE_CHECKING:
    from ..models import ModelConfig


def matrix(t: torch.Tensor) -> torch.Tensor:
    """The 2-D view the planner works on: [shape[0], prod(shape[1:])]."""
    return t.reshape(t.shape[0], -1)


def cut(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The local tensor [rows + pad, width] of `region` from the full parameter (padding zero)."""
    m = matrix(full)
    out = full.new_zeros(region.rows + region.pad, region.width)
    if region.rects:
        out[: region.rows] = torch.cat([m[r.r0 : r.r1, r.c0 : r.c1] for r in region.rects])
    return out


def shard_state_dict(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int,
                     vision: bool = False) -> dict[str, torch.Tensor]:
    """This TP rank's tensor of every parameter in `full` (names as in `Qwen25VL.named_parameters`):
    the rollout layout's shard, shaped like the parameter with its split dim cut; the vision tower's
    blocks too when `vision`."""
    layout = RolloutLayout(tp, vision_tp=vision)
    specs = {s.name: s for s in model_specs(cfg)}
    out = {}
    for name, t in full.items():
        spec = specs[name]
        if spec.tp_dim is None or tp == 1 or (spec.tower == "vision" and not vision):  # whole on every rank
            out[name] = t
            continue
        region = layout.region(spec, rank)
        local = cut(t, region)
        shape = list(t.shape)
        shape[spec.tp_dim] = region.rows if spec.tp_dim == 0 else region.width
        out[name] = local.view(shape)
    return out


def block(flat: torch.Tensor, offset: int, pitch: int, rows: int, width: int) -> torch.Tensor:
    """rows x width elements of a flat tensor, element (i, j) at offset + i * pitch + j: a view."""
    assert flat.dim() == 1 and offset + (rows - 1) * pitch + width <= flat.numel()
    return flat.as_strided((rows, width), (pitch, 1), flat.storage_offset() + offset)


def src_block(train: torch.Tensor, c: Copy) -> torch.Tensor:
    return block(train.view(-1), c.src_offset, c.src_pitch, c.rows, c.width)


def dst_block(rollout: torch.Tensor, c: Copy) -> torch.Tensor:
    return block(rollout.view(-1), c.dst_offset, c.dst_pitch, c.rows, c.width)


@dataclass
class ParamTensors:
    buffer: torch.Tensor | None  # the joint buffer, or None when nothing is shared
    train: torch.Tensor  # [rows + pad, width], padded like FSDP2's shard
    rollout: torch.Tensor  # [rows, width]


def allocate(p: ParamPlan, dtype: torch.dtype, device=None, train_dtype: torch.dtype | None = None) -> ParamTensors:
    s, t, sh = p.rollout, p.train, p.share
    if sh is None:
        train = torch.zeros(t.rows + t.pad, t.width, dtype=train_dtype or dtype, device=device)
        return ParamTensors(None, train, torch.zeros(s.rows, s.width, dtype=dtype, device=device))
    if train_dtype not in (None, dtype):
        raise ValueError("shared storage needs the training tensor in the rollout dtype")
    buf = torch.zeros(sh.buffer_numel, dtype=dtype, device=device)
    train = buf[sh.train_offset : sh.train_offset + sh.train_numel].view(t.rows + t.pad, t.width)
    rollout = buf[sh.rollout_offset : sh.rollout_offset + s.numel].view(s.rows, s.width)
    return ParamTensors(buf, train, rollout)


def rebuild_local(p: ParamPlan, rollout: torch.Tensor, train_of: Callable[[int], torch.Tensor]) -> None:
    """Copy every rebuilt block into `rollout` from train_of(rank), each rank's training tensor."""
    for c in p.copies:
        dst_block(rollout, c).copy_(src_block(train_of(c.src), c))


def rebuild(plan: ModelPlan, rank: int, train: dict[str, torch.Tensor], rollout: dict[str, torch.Tensor],
            group: dist.ProcessGroup | None = None) -> None:
    """Collective over the plan's ranks (`rank` is this process's rank in `group`): fill this rank's
    rollout tensors' rebuilt blocks from the training tensors of all ranks. A rank with nothing to
    send or receive posts no P2P op; NCCL requires batched P2P not to be the group's first
    collective unless every rank takes part, so initialise the group with a collective first (FSDP's
    do)."""
    sends: dict[int, list[torch.Tensor]] = {}
    recvs: dict[int, list[torch.Tensor]] = {}
    for spec in plan.specs:
        mine = plan.param(spec.name, rank)
        for c in mine.copies:
            if c.src == rank:
                dst_block(rollout[spec.name], c).copy_(src_block(train[spec.name], c))
            else:
                recvs.setdefault(c.src, []).append(dst_block(rollout[spec.name], c))
        for peer in range(plan.world):
            if peer != rank:
                for c in plan.param(spec.name, peer).copies:
                    if c.src == rank:
                        sends.setdefault(peer, []).append(src_block(train[spec.name], c))
    ops, inbox = [], {}
    ref = next(iter(train.values()))
    for peer in sorted(set(sends) | set(recvs)):
        gpeer = peer if group is None else dist.get_global_rank(group, peer)
        if peer in sends:
            out = torch.cat([b.reshape(-1) for b in sends[peer]])
            ops.append(dist.P2POp(dist.isend, out, gpeer, group))
        if peer in recvs:
            inbox[peer] = torch.empty(sum(b.numel() for b in recvs[peer]), dtype=ref.dtype, device=ref.device)
            ops.append(dist.P2POp(dist.irecv, inbox[peer], gpeer, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for peer, blocks in recvs.items():
        off = 0
        for b in blocks:
            b.copy_(inbox[peer][off : off + b.numel()].view(b.shape))
            off += b.numel()
