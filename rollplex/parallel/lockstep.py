"""Whole parameters of an FSDP2-sharded model's modules, all-gathered outside FSDP2 on a group of their own.

The co-scheduler runs a sharded model's prefix work beside each rank's decode (cosched/sharded.py):
each piece needs the whole parameters of a few modules (a decoder layer, a vision block, the token
embeddings), gathered from every rank's shard. FSDP2's own gathers cannot serve it: they run on the
trainer's group, whose collectives every rank issues in one order with the step's other collectives
(the rollout's gather of outputs, scoring, the update), while the decode loops of different ranks admit
prefix work at different times. So `ShardGather` gathers on a process group used by nothing else —
every rank issues the same gathers in the same order there, each at its own pace — and asynchronously:
a rank never waits in a decode step for a slower one. On GPUs the wait is the stream's (the work
queued after a gather runs when every rank's shard has arrived); on CPU (gloo) `ready()` polls, so
the caller runs a piece once its gather completed.

A gather is one all-gather per dtype of the modules' local shards, packed in FSDP2's layout
(`Shard(0)`, rows split in chunks of ceil(rows / world), the last ranks' chunks short or empty; or
`Shard(1)`, even column windows), so
the whole tensors are the same bytes FSDP2's unshard produces: running a piece on them computes what
the model computes in its scoring passes. `Gathered.swapped()` puts them in the modules for the call
(and routes the model's layer slots past FSDP2's hooks), then puts the shards back.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from .fsdp import _direct_flag, units

# (all_gather_into_tensor: its name before all_gather_single)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Gathered:
    """One gather in flight or done: the modules' whole parameters once `wait()` returned."""

    def __init__(self, model: nn.Module, slots: list[tuple[nn.Module, str, torch.Tensor]], world: int,
                 group: dist.ProcessGroup):
        self.model, self.slots, self.world = model, slots, world
        self.cuda = any(p.is_cuda for _, _, p in slots)
        self.full: list[torch.Tensor | None] = [None] * len(slots)
        self._works: list = []
        self._outs: list[tuple[list[int], torch.Tensor, list[int]]] = []  # (slot indices, output, chunk numels)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (_, _, p) in enumerate(slots):
            if isinstance(p, DTensor):
                by_dtype.setdefault(p.dtype, []).append(i)
            else:  # not sharded: the tensor is whole already
                self.full[i] = p.detach()
        for dtype in sorted(by_dtype, key=str):  # the same collectives in the same order on every rank
            idx = by_dtype[dtype]
            sizes = [self._chunk_numel(slots[i][2]) for i in idx]
            inp = torch.empty(sum(sizes), dtype=dtype, device=slots[idx[0]][2].device)
            off = 0
            for i, n in zip(idx, sizes):
                local = slots[i][2].to_local().detach().reshape(-1)
                inp[off : off + local.numel()].copy_(local)
                off += n
            out = torch.empty(world * inp.numel(), dtype=dtype, device=inp.device)
            self._works.append(_all_gather(out, inp, group=group, async_op=True))
            self._outs.append((idx, out, sizes))

    def _chunk_numel(self, p: DTensor) -> int:
        """Elements of every rank's (padded) chunk: ceil(rows / world) whole rows, or (`Shard(1)`, even
        only) all rows of a column window."""
        if tuple(p.placements) == (Shard(1),) and p.ndim == 2 and p.shape[1] % self.world == 0:
            return p.numel() // self.world
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"a lockstep gather reads FSDP2's Shard(0) or even Shard(1) parameters, got "
                             f"{p.placements} of {tuple(p.shape)}")
        rows = p.shape[0]
        return math.ceil(rows / self.world) * (p.numel() // rows if rows else 0)

    def ready(self) -> bool:
        """Whether work on the whole tensors may be queued now: on GPUs at once (the stream waits for the
        gathers), on CPU once every rank's shards arrived."""
        return self.cuda or all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        """The whole tensors, unpacked (on GPUs the current stream waits for the gathers; the host does not)."""
        for w in self._works:
            w.wait()
        self._works = []
        for idx, out, sizes in self._outs:
            per_rank = out.view(self.world, -1)
            off = 0
            for i, n in zip(idx, sizes):
                p = self.slots[i][2]
                chunk = per_rank[:, off : off + n]  # [world, one rank's chunk]
                if p.placements[0].dim == 1:  # column windows side by side
                    rows = p.shape[0]
                    self.full[i] = chunk.view(self.world, rows, -1).transpose(0, 1).reshape(p.shape)
                else:
                    self.full[i] = chunk.reshape(-1, *p.shape[1:])[: p.shape[0]]
                off += n
        self._outs = []

    @contextlib.contextmanager
    def swapped(self):
        """Inside: the modules hold the whole parameters and the model's layers run past FSDP2's hooks."""
        if self._works or self._outs:
            self.wait()
        direct = _direct_flag(self.model)
        flag, direct[0] = direct[0], True
        for (mod, name, _), t in zip(self.slots, self.full):
            mod._parameters[name] = nn.Parameter(t, requires_grad=False)
        try:
            yield
        finally:
            for mod, name, p in self.slots:
                mod._parameters[name] = p
            direct[0] = flag

    def release(self) -> None:
        self.full = [None] * len(self.slots)


class ShardGather:
    """Gathers of an FSDP2-sharded model's modules over `group` (a process group of the same ranks as the
    model's mesh, in the same order, that nothing else issues collectives on)."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup):
        self.model, self.group = model, group
        self.world = dist.get_world_size(group)
        for u in units(model):  # the shards at rest: what a module's parameters are between FSDP2 passes
            u.reshard()

    def gather(self, modules: list[nn.Module]) -> Gathered:
        seen, slots = set(), []
        for top in modules:
            for mod in top.modules():
                for name, p in mod._parameters.items():
                    if p is not None and id(p) not in seen:
                        seen.add(id(p))
                        slots.append((mod, name, p))
        return Gathered(self.model, slots, self.world, self.group)

