"""AdamW over fp32 master weights, stepped a chunk of parameters at a time, optionally paged from the CPU.

Low-precision (bf16) parameters get fp32 master copies; fp32 parameters are their own masters. The
gradient buffers are persistent (allocated once, in the `grads` region when a memory manager is
given, and zeroed instead of freed) so the region can be released outside the update and backward
accumulates into fixed addresses. `regions` names the (optimizer state, gradients) tags: the actor's
`optimizer` / `grads`, the critic's `critic_optimizer` / `critic_grads`.

`step()` walks the parameters in chunks of about `chunk_bytes`: only that chunk's fp32 gradients
exist at once (not a full fp32 copy of every gradient). `offload` moves state to pinned host memory,
each chunk paged onto the device for its step and back (what lets a model whose optimizer state
exceeds the device train on it): "moments" pages the two AdamW moments (8 bytes per parameter) and
keeps the fp32 masters on the device; "all" pages the masters too (12 bytes per parameter); "cpu"
keeps all of it on the host and runs the AdamW step there instead (gradients go down, updated
weights come up: 6 bytes per parameter over the bus rather than 24, for the CPU's arithmetic). The math is
torch.optim.AdamW's, element for element: chunking only changes which parameters one call updates
(AdamW skips parameters without a gradient), so every mode gives the same weights.

A step that runs out of device memory raises OptimizerStepOOM saying how many chunks it updated and
whether the next may hold part of its update ("torn"): a chunk's page-in copies and fp32 gradients are
allocated before anything is written (an OOM there leaves the chunk as it was), masters and moments
paged onto a GPU are restored from their untouched host copies; an OOM inside AdamW's own temporaries
otherwise leaves that chunk torn, its weights then set from its masters.

Sharded parameters (FSDP2 DTensors) are stepped through their local shards: the masters, moments and
gradient buffers are plain tensors of this rank's shard (AdamW is elementwise, so stepping the shards
equals stepping the whole tensors), which is also what a memory region holds and an offload copies.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.distributed.tensor import DTensor

from ..memory import host_buffers

MOMENTS = ("exp_avg", "exp_avg_sq")
OFFLOAD_MODES = ("none", "moments", "all", "cpu")


class MasterAdamW:
    def __init__(self, params: list[torch.nn.Parameter], chunk_bytes: int = 1 << 30, offload: str = "none",
                 memory=None, regions: tuple[str, str] = ("optimizer", "grads"), **kw):
        if not params:
            raise ValueError("no trainable parameters")
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"optimizer offload must be one of {OFFLOAD_MODES}, got {offload!r}")
        self.params, self.memory = params, memory
        self.state_tag, self.grads_tag = regions
        self.offload = offload in ("moments", "all")  # paged through the device in the step
        self._slots: dict[tuple[int, str], torch.Tensor] | None = None  # paged moments' host tensors
        self._page_masters = offload == "all"
        self._cpu_step = offload == "cpu"
        self.device = params[0].device
        self._pin = offload != "none" and self.device.type == "cuda"
        # the tensors the step writes: the parameters themselves, or their shards' local tensors
        self.local = [_local(p.detach()) if isinstance(p, DTensor) else p for p in params]
        with torch.no_grad(), self._region(self.state_tag):
            if self._page_masters or self._cpu_step:
                self.master = self._host_buffers([(t.shape, torch.float32) for t in self.local])
                for m, t in zip(self.master, self.local):
                    m.copy_(t.detach())
            elif params[0].dtype == torch.float32:
                self.master = self.local  # fp32 parameters are their own masters
            else:
                self.master = [t.detach().float().clone() for t in self.local]
        if memory is not None:
            memory.preserve(self.state_tag, self.state_tensors)
        self.opt = torch.optim.AdamW(self.master, **kw)
        self.chunks: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(params):
            if self.chunks[-1] and size + 4 * p.numel() > chunk_bytes:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += 4 * p.numel()
        self._grads_ready = False
        # parameters that received a gradient since zero_grad: only they are clipped and stepped, as
        # torch.optim skips parameters whose .grad is None (a batch without images leaves the vision
        # tower untouched: no weight decay, no moment update)
        self.touched: set[int] = set()
        touched = self.touched  # the hooks hold the set, not the optimizer: a dropped optimizer is freed
        self._hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: touched.add(i))
                       for i, p in enumerate(params)]

    @property
    def param_groups(self) -> list[dict]:
        """AdamW's param groups, read afresh: `load_state_dict` replaces the list (a reference kept across a
        load would take lr writes the step no longer reads)."""
        return self.opt.param_groups

    def _region(self, tag: str):
        return self.memory.region(tag) if self.memory is not None else contextlib.nullcontext()

    def _host_buffers(self, specs: list) -> list[torch.Tensor]:
        """Host tensors for paged state, views of one allocation (memory.host_buffers), page-locked on a GPU,
        their allocation time reported to the memory manager: pinning is slow the first time."""
        return host_buffers(specs, self._pin, self.memory.record_host_alloc if self.memory is not None else None)

    def _moment_slot(self, i: int, k: str) -> torch.Tensor:
        """The host tensor that keeps master i's moment k between paged steps: a view of one allocation for
        all moments, made at the first page-out. PyTorch's pinned allocator rounds each allocation up to a
        power of two, so a pinned tensor per moment took 121 GiB of host memory for the 7B's 62 GiB of moments;
        one allocation rounds once."""
        if self._slots is None:
            keys = [(j, name) for j in range(len(self.master)) for name in MOMENTS]
            bufs = self._host_buffers([(self.master[j].shape, torch.float32) for j, _ in keys])
            self._slots = dict(zip(keys, bufs))
        return self._slots[i, k]

    # ---- gradients ----------------------------------------------------------------------------
    def _alloc_grads(self) -> None:
        with self._region(self.grads_tag):
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # zeroed again by the caller
        if self.memory is not None:
            self.memory.on_resume(self.grads_tag, self.zero_grad)
        self._grads_ready = True

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the persistent gradient buffers (allocated when missing); set_to_none frees them instead (when no
        memory manager releases them between updates)."""
        self.touched.clear()
        if set_to_none:
            for p in self.params:
                p.grad = None
            return
        if not self._grads_ready or any(p.grad is None for p in self.params):
            self._alloc_grads()
        for p in self.params:
            _local(p.grad).zero_()

    def close(self) -> None:
        """Detach from the parameters (gradient hooks) so another optimizer can take them over."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def touched_params(self) -> list[torch.nn.Parameter]:
        """The parameters that received a gradient since zero_grad (what clipping and the step see)."""
        return [self.params[i] for i in sorted(self.touched)]

    # ---- state --------------------------------------------------------------------------------
    def state_tensors(self) -> list[torch.Tensor]:
        """Masters (when separate from the parameters) and moments: what an offload of the region keeps."""
        out = [] if self.master is self.local else list(self.master)
        for m in self.master:
            st = self.opt.state.get(m, {})
            out.extend(st[k] for k in MOMENTS if k in st)
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        with self._region(self.state_tag):  # the moments are created at the first step: in the region
            self._step()

    def _step(self) -> None:
        grads = [p.grad for p in self.params]
        live = [_local(g) if i in self.touched else None for i, g in enumerate(grads)]
        for m in self.master:
            m.grad = None  # AdamW steps only the parameters that have one: the current chunk's
        chunks = [c for c in self.chunks if any(live[i] is not None for i in c)]
        written = 0
        try:
            for chunk in chunks:
                self._step_chunk(chunk, live)
                written += 1
        except _TornChunk as e:
            raise OptimizerStepOOM(written, len(chunks), e.torn) from e.__cause__
        finally:
            for p, g in zip(self.params, grads):
                p.grad = g  # the persistent buffers (the masters of fp32 parameters are the parameters)
        if self._cpu_step and self._pin:  # the next step writes the host masters the uploads read
            torch.cuda.current_stream(self.device).synchronize()

    def _step_chunk(self, chunk: list[int], live: list) -> None:
        """One chunk's AdamW step. What can run out of memory before the update (paging in, the fp32
        gradients) is allocated before anything is written; an out-of-memory error raises _TornChunk,
        saying whether the chunk may hold part of an update (AdamW's own temporaries, or paging out)."""
        phase, paged = "prepare", None
        # the chunk's step counters (scalars): put back when a paged chunk fails before its update is kept
        counters = {i: self.opt.state[self.master[i]].get("step") if self.master[i] in self.opt.state else None
                    for i in chunk}
        counters = {i: (None if c is None else c.clone()) for i, c in counters.items()}
        try:
            paged = self._page_in(chunk) if self.offload else None
            for i in chunk:
                g, m = live[i], self.master[i]
                # a device -> host copy is blocking: the CPU step reads it next
                m.grad = None if g is None else (g if g.dtype == m.dtype and g.device == m.device
                                                 else g.to(device=m.device, dtype=m.dtype))
            phase = "step"
            self.opt.step()
            for i in chunk:
                if self.master[i] is not self.local[i]:
                    self.local[i].copy_(self.master[i], non_blocking=self._pin)
                self.master[i].grad = None
            phase = "page_out"
            if paged is not None:
                self._page_out(chunk, paged)
        except BaseException as e:
            for i in chunk:
                self.master[i].grad = None
            # before the update, or with masters and moments paged onto a GPU (their host copies are untouched
            # until the page-out): the chunk is as it was
            exact = phase == "prepare" or (phase == "step" and self._page_masters and self.device.type == "cuda")
            if paged is not None and phase != "page_out":
                self._restore(chunk, paged, counters if exact else None)
            if not exact:
                with torch.no_grad():  # the weights show what the masters hold
                    for i in chunk:
                        if self.master[i] is not self.local[i]:
                            self.local[i].copy_(self.master[i])
            if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
                raise _TornChunk(not exact) from e
            raise

    def _page_in(self, chunk: list[int]) -> dict:
        """Point the chunk's masters and moments at device copies; returns the host tensors to restore.
        Every copy is made before any tensor is repointed, so running out of memory here changes nothing."""
        nb = self._pin
        host, dev = {}, {}
        for i in chunk:
            m = self.master[i]
            st = self.opt.state.get(m, {})
            host[i] = (m.data, {k: st[k] for k in MOMENTS if k in st})
            dev[i] = (m.data.to(self.device, non_blocking=nb) if self._page_masters else None,
                      {k: t.to(self.device, non_blocking=nb) for k, t in host[i][1].items()})
        for i in chunk:
            m = self.master[i]
            if self._page_masters:
                m.data = dev[i][0]
            if dev[i][1]:
                self.opt.state[m].update(dev[i][1])
        return host

    def _restore(self, chunk: list[int], host: dict, counters: dict | None) -> None:
        """A chunk whose step failed before its page-out: masters and moments back on their host tensors
        (the device copies dropped); with `counters`, AdamW's step counts too (state it made is dropped)."""
        for i in chunk:
            m = self.master[i]
            hm, hmom = host[i]
            if self._page_masters:
                m.data = hm
            st = self.opt.state.get(m)
            if st is None:
                continue
            if counters is not None and counters[i] is None:
                del self.opt.state[m]  # its first step: no state before it
                continue
            for k in MOMENTS:
                if k in hmom:
                    st[k] = hmom[k]
                elif counters is not None:
                    st.pop(k, None)
            if counters is not None and counters[i] is not None:
                st["step"] = counters[i]

    def _page_out(self, chunk: list[int], host: dict) -> None:
        nb = self._pin
        for i in chunk:
            m = self.master[i]
            hm, hmom = host[i]
            if self._page_masters:
                hm.copy_(m.data, non_blocking=nb)
                m.data = hm
            st = self.opt.state[m]
            for k in MOMENTS:
                if k not in st:  # never stepped (no gradient yet): no moments to keep
                    continue
                if k in hmom:
                    hmom[k].copy_(st[k], non_blocking=nb)
                else:  # first step: the moments were just created on the device
                    hmom[k] = self._moment_slot(i, k)
                    hmom[k].copy_(st[k], non_blocking=nb)
                st[k] = hmom[k]
        if nb:
            torch.cuda.current_stream(self.device).synchronize()

    def state_dict(self, masters: bool = True) -> dict:
        """AdamW's state and the fp32 masters; `masters=False` leaves the masters out (None each): where the
        weights are stored elsewhere in fp32, the masters would store them twice."""
        return {"opt": self.opt.state_dict(),
                "master": [m.detach().cpu() if masters else None for m in self.master]}

    def check_state_dict(self, sd: dict) -> None:
        """ValueError unless `sd` is a state_dict of an optimizer over parameters of these shapes with
        finite values (what `load_state_dict` needs); changes nothing."""
        if not isinstance(sd, dict) or not isinstance(sd.get("opt"), dict):
            raise ValueError("the optimizer state is not a MasterAdamW state_dict")
        opt, n = sd["opt"], len(self.master)
        groups = opt.get("param_groups")
        if (not isinstance(groups, list) or len(groups) != len(self.opt.param_groups)
                or [len(g.get("params", ())) for g in groups] != [len(g["params"]) for g in self.opt.param_groups]):
            raise ValueError(f"the optimizer state is for other parameters (this run trains {n} tensors)")
        state = opt.get("state")
        if not isinstance(state, dict) or not all(isinstance(i, int) and 0 <= i < n for i in state):
            raise ValueError("the optimizer state names parameters this run does not have")
        for i, st in state.items():
            for k, t in st.items():
                if k in MOMENTS:
                    _check_tensor(t, self.master[i].shape, f"the optimizer's {k} of parameter {i}")
                elif k == "step" and not (isinstance(t, (int, float, torch.Tensor)) and math.isfinite(float(t))
                                          and float(t) >= 0):
                    raise ValueError(f"the optimizer's step count of parameter {i} is not a count")
        masters = sd.get("master")
        if masters is not None and (not isinstance(masters, list) or len(masters) != n):
            raise ValueError(f"the optimizer state holds {len(masters) if isinstance(masters, list) else 'no'} "
                             f"master weights for {n} parameters")
        for i, t in enumerate(masters or ()):
            if t is not None:
                _check_tensor(t, self.master[i].shape, f"the master weights of parameter {i}")

    def load_state_dict(self, sd: dict, weights_dtype: torch.dtype | None = None) -> int:
        """Restore AdamW's state. The parameters already hold the checkpoint's weights (its HF files are the
        source of truth); a saved master takes a parameter's place where it rounds to it (compared in the
        parameter's dtype, or `weights_dtype` — the stored weights' — for fp32 parameters), otherwise the
        master is rebuilt from the parameter (the weights were edited since the save). Returns how many
        saved masters were rebuilt that way."""
        with self._region(self.state_tag):  # the loaded moments are new tensors: in the region
            self.opt.load_state_dict(sd["opt"])
        rebuilt = 0
        with torch.no_grad():
            for m, s, p in zip(self.master, sd.get("master") or [None] * len(self.master), self.local):
                d = p.dtype if p.dtype != torch.float32 else (weights_dtype or p.dtype)
                if s is not None and torch.equal(s.to(device=p.device, dtype=d), p.to(d)):
                    m.copy_(s)  # a separate master, or an fp32 parameter whose stored weights are rounded
                    continue
                rebuilt += s is not None
                if m is not p:
                    m.copy_(p)
            if self.offload:  # load_state_dict moves the moments to the masters' device: back into the slots
                for i, m in enumerate(self.master):
                    st = self.opt.state.get(m, {})
                    for k in MOMENTS:
                        if k in st and st[k] is not self._moment_slot(i, k):
                            st[k] = self._moment_slot(i, k).copy_(st[k])
        return rebuilt


def _check_tensor(t, shape, what: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{what}: not a floating-point tensor")
    if t.shape != shape:
        raise ValueError(f"{what}: shape {tuple(t.shape)}, this run has {tuple(shape)}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what}: non-finite values")


class OptimizerStepOOM(torch.OutOfMemoryError):
    """Out of memory inside `MasterAdamW.step` after `written` of its `total` parameter chunks were
    updated; `torn`: the next chunk may hold part of its update (otherwise it is as before the step)."""

    def __init__(self, written: int, total: int, torn: bool):
        super().__init__(f"out of device memory in the optimizer step after {written} of {total} parameter chunks"
                         + (" (the next one possibly updated in part)" if torn else ""))
        self.written, self.total, self.torn = written, total, torn

    @property
    def changed(self) -> bool:
        return self.written > 0 or self.torn


class _TornChunk(Exception):
    def __init__(self, torn: bool):
        super().__init__("a chunk's step ran out of memory")
        self.torn = torn


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage); other tensors as they are."""
    return t._local_tensor if isinstance(t, DTensor) else t
