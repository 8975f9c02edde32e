"""The phase-aware memory manager: drives tagged regions through an RL step's phases.

Owners allocate their large tensors inside `mm.region(tag)` (the engine its KV cache, the trainer its
optimizer state and gradients, the RL step its reference model) and register what must survive a
pause with `mm.preserve(tag, tensors_fn)`. `mm.phase(name)` then moves every region to the residency
the plan gives it for that phase — pausing and offloading what leaves first, so the memory is free
before anything comes back — and records the phase's resident bytes and peak in the ledger.

Offloads are the manager's own, not the backend's: a pinned CPU buffer per preserved tensor,
allocated once and reused; a frozen tag (reference weights) is copied out once and every later pause
is free. A region whose contents are dropped can register `on_resume` (gradients are zeroed).

`device_capacity` is where the plan's device size comes from (one place: an explicit size, the CUDA
device's total memory, or the capacity an accounting backend plays). `set_plan` may carry the
`MemoryFit` it came from (fit.py), which `report()` includes.

Every misuse is a `MemoryRegionError` raised before the backend is touched (torch-memory-saver ends
the process on a double pause or a resume of an active region): pausing a paused region, resuming a
resident one, allocating into a paused one, resuming without enough free memory.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable

import torch

from .backend import make_backend
from .ledger import Ledger
from .plan import FROZEN, PHASES, TAGS, PhasePlan


class MemoryRegionError(RuntimeError):
    pass


class MemoryManager:
    def __init__(self, plan: PhasePlan, device: torch.device | str = "cpu", backend: str | object = "auto",
                 capacity: int | None = None, resume_margin: int = 256 << 20):
        self.plan = plan
        self.device = torch.device(device)
        self.backend = make_backend(backend, self.device, capacity) if isinstance(backend, str) else backend
        self.resume_margin = resume_margin
        self.state = {t: "resident" for t in TAGS}  # resident | released | offloaded
        self.current: str | None = None
        self.ledger = Ledger()
        self._segments0 = 0  # the allocator's segment count when the current phase's measurement began
        self._preserve: dict[str, Callable[[], Iterable[torch.Tensor]]] = {}
        self._on_resume: dict[str, Callable[[], None]] = {}
        self._copies: dict[str, tuple[tuple, list[torch.Tensor]]] = {}  # tag -> (key of the sources, cpu buffers)
        self.fit: dict | None = None  # how the plan was chosen (MemoryFit.to_dict), when set_plan was given one

    # ---- allocation ---------------------------------------------------------------------------
    def _check_tag(self, tag: str) -> None:
        if tag not in TAGS:
            raise MemoryRegionError(f"unknown memory tag {tag!r}; tags are {TAGS}")

    @contextlib.contextmanager
    def region(self, tag: str):
        """Allocations made inside belong to `tag`'s region."""
        self._check_tag(tag)
        if self.state[tag] != "resident":
            raise MemoryRegionError(f"cannot allocate in the {tag} region: it is {self.state[tag]}")
        with self.backend.region(tag):
            yield

    def preserve(self, tag: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        """The tensors whose contents an offload of `tag` keeps (called at each offload: the current set)."""
        self._check_tag(tag)
        self._preserve[tag] = tensors

    def on_resume(self, tag: str, fn: Callable[[], None]) -> None:
        """Run after `tag` comes back from a release (its contents are undefined then)."""
        self._check_tag(tag)
        self._on_resume[tag] = fn

    def forget(self, tag: str) -> None:
        """Drop what `preserve` / `on_resume` registered for `tag`, and its host copy: its owner is gone (a new
        one registers its own), and nothing here keeps the old owner's tensors alive."""
        self._check_tag(tag)
        self._preserve.pop(tag, None)
        self._on_resume.pop(tag, None)
        self._copies.pop(tag, None)

    def region_bytes(self, tag: str) -> int:
        return self.backend.region_bytes(tag)

    # ---- transitions --------------------------------------------------------------------------
    def pause(self, tag: str, offload: bool = False) -> None:
        self._check_tag(tag)
        if self.state[tag] != "resident":
            raise MemoryRegionError(f"the {tag} region is already {self.state[tag]}")
        t0 = time.perf_counter()
        copied = self._copy_out(tag) if offload else 0
        self.backend.pause(tag)
        self.state[tag] = "offloaded" if offload else "released"
        self.ledger.record_transition("pause", tag, time.perf_counter() - t0, copied)

    def resume(self, tag: str) -> None:
        self._check_tag(tag)
        state = self.state[tag]
        if state == "resident":
            raise MemoryRegionError(f"the {tag} region is already resident")
        t0 = time.perf_counter()
        need = self.backend.region_bytes(tag)
        paused = {t for t, s in self.state.items() if s != "resident"}
        free = self.backend.free_bytes(paused)
        if need + self.resume_margin > free and self.device.type == "cuda":
            torch.cuda.empty_cache()  # blocks cached by the default pool are free to the region's pool
            free = self.backend.free_bytes(paused)
        if need + (self.resume_margin if self.device.type == "cuda" else 0) > free:
            raise MemoryRegionError(f"cannot resume the {tag} region: it needs {need / 2**30:.2f} GiB and "
                                    f"{free / 2**30:.2f} GiB are free; release other regions first")
        self.backend.resume(tag)
        self.state[tag] = "resident"
        copied = self._copy_in(tag) if state == "offloaded" else 0
        if state == "released" and tag in self._on_resume:
            self._on_resume[tag]()
        self.backend.synchronize()
        self.ledger.record_transition("resume", tag, time.perf_counter() - t0, copied)

    def enter(self, phase: str) -> None:
        """Move every region to its residency in `phase`: out-going first, then in-coming."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        self._close_peak()
        want = {t: self.plan.get(phase, t) for t in TAGS}
        for tag in TAGS:
            if want[tag] != "resident" and self.state[tag] == "resident":
                self.pause(tag, offload=want[tag] == "offloaded")
            elif want[tag] != "resident" and self.state[tag] != want[tag]:
                # released -> offloaded would need contents it no longer has; offloaded -> released is a no-op
                # on the device, and the CPU copy stays valid for the next resume
                pass
        for tag in TAGS:
            if want[tag] == "resident" and self.state[tag] != "resident":
                self.resume(tag)
        self.current = phase
        self.ledger.record_phase(phase, {t: self.backend.region_bytes(t) for t in TAGS
                                         if self.state[t] == "resident"})

    @contextlib.contextmanager
    def phase(self, phase: str):
        """enter(phase) for the body (the phase lasts until the next enter: its peak is recorded then)."""
        self.enter(phase)
        yield

    def _device_peak(self) -> int:
        """Peak bytes in use on the device since the last reset. The allocator still counts the tensors of a
        paused region as allocated (their addresses stay reserved) though their memory went back to the
        device, so the bytes of the regions paused throughout the phase are taken off."""
        paused = sum(self.backend.region_bytes(t) for t, s in self.state.items() if s != "resident")
        return max(0, torch.cuda.max_memory_allocated(self.device) - paused)

    def _segments(self) -> int:
        """Device segments the caching allocator has requested so far (one cudaMalloc or region map each)."""
        return int(torch.cuda.memory_stats(self.device).get("segment.all.allocated", 0))

    def _record_current(self) -> None:
        """Into the ledger: the current phase's peak device memory and the allocations since the last record."""
        segments = self._segments()
        if self.current is not None:
            self.ledger.record_peak(self.current, self._device_peak())
            self.ledger.record_mallocs(self.current, segments - self._segments0)
        self._segments0 = segments

    def _close_peak(self) -> None:
        """Record the current phase's peak device memory and allocations, and start a new measurement."""
        if self.device.type != "cuda":
            return
        self._record_current()
        torch.cuda.reset_peak_memory_stats(self.device)

    def take_metrics(self) -> dict[str, float]:
        """`memory/*` metrics since the last call (the current phase's peak and allocations so far included)."""
        if self.device.type == "cuda":
            self._record_current()
        return self.ledger.take_metrics()

    @contextlib.contextmanager
    def resident(self, tags, modified: bool = False):
        """`tags` resident for the body (resumed where paused), then back to what the current phase gives them.
        modified: the body changed their contents (a frozen tag's CPU copy is taken again at its next pause)."""
        back = [t for t in tags if self.state[t] != "resident"]
        for t in back:
            self.resume(t)
        try:
            yield
        finally:
            if modified:
                for t in tags:
                    self._copies.pop(t, None)
            for t in back:
                self.pause(t, offload=self.current is not None and self.plan.get(self.current, t) == "offloaded")

    def set_plan(self, plan: PhasePlan, fit: dict | None = None) -> None:
        self.plan = plan
        self.fit = fit
        if self.current is not None:
            self.enter(self.current)

    # ---- offload copies -----------------------------------------------------------------------
    def _copy_out(self, tag: str) -> int:
        fn = self._preserve.get(tag)
        if fn is None:
            return 0
        src = [t for t in fn() if t is not None]
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in src)
        old = self._copies.get(tag)
        if tag in FROZEN and old is not None and old[0] == key:
            return 0  # contents cannot have changed since the copy was taken
        pin = self.device.type == "cuda"
        if old is not None and [(b.shape, b.dtype) for b in old[1]] == [(t.shape, t.dtype) for t in src]:
            bufs = old[1]
        else:
            bufs = host_buffers([(t.shape, t.dtype) for t in src], pin, self.record_host_alloc)
        for b, t in zip(bufs, src):
            b.copy_(t.detach(), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)
        self._copies[tag] = (key, bufs)
        return sum(t.numel() * t.element_size() for t in src)

    def _copy_in(self, tag: str) -> int:
        fn = self._preserve.get(tag)
        if fn is None:
            return 0
        src = [t for t in fn() if t is not None]
        entry = self._copies.get(tag)
        key = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in src)
        if entry is None or entry[0] != key:
            raise MemoryRegionError(f"the {tag} region's tensors changed while it was offloaded; "
                                    "its CPU copy no longer matches them")
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for t, b in zip(src, entry[1]):
                t.copy_(b, non_blocking=pin)
        return sum(t.numel() * t.element_size() for t in src)

    def record_host_alloc(self, seconds: float, nbytes: int) -> None:
        """A host buffer made for offloaded state (this manager's copies, an optimizer's paged state): its
        seconds and bytes reach the step's `memory/host_alloc_*` metrics."""
        self.ledger.record_host_alloc(seconds, nbytes)

    # ---- reporting ----------------------------------------------------------------------------
    def report(self) -> dict:
        return {"backend": self.backend.name, "phase": self.current, "plan": self.plan.to_dict(), "fit": self.fit,
                "state": dict(self.state),
                "region_bytes": {t: self.backend.region_bytes(t) for t in TAGS},
                "phases": self.ledger.to_dict()}

    def table(self) -> str:
        sizes = {t: self.backend.region_bytes(t) for t in TAGS}
        return self.plan.table(sizes) + "\n" + self.ledger.table(TAGS)


def device_capacity(device: torch.device | str, backend=None, override_gib: float | None = None) -> int | None:
    """Bytes of device memory a memory plan is sized against: `override_gib` when given (tests; or a
    share of the device left to something else); a CUDA device's total memory; else the capacity the
    memory backend plays (the accounting backend's), or None: unlimited, nothing is checked."""
    if override_gib is not None:
        return int(override_gib * 2**30)
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return getattr(backend, "capacity", None)


def host_memory() -> int | None:
    """Bytes of the host's physical memory (None where the platform does not say): what pinned offloads
    share with the process's own host memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_buffers(specs: list[tuple[torch.Size, torch.dtype]], pin: bool,
                 record: Callable[[float, int], None] | None = None) -> list[torch.Tensor]:
    """CPU tensors of the given (shape, dtype)s, views of one (pinned) allocation: one cudaHostAlloc instead
    of one per tensor, which is what makes the first offload of many tensors slow, and one rounding (torch's
    pinned allocator rounds each allocation up to a power of two). `record(seconds, bytes)` hears the time
    and the views' bytes (MemoryManager.record_host_alloc)."""
    align = 64
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // align) * align
    t0 = time.perf_counter()
    flat = torch.empty(total, dtype=torch.uint8, device="cpu", pin_memory=pin)
    if record is not None:
        record(time.perf_counter() - t0, sum(sizes))
    return [flat[o:o + n].view(dtype).view(shape) for o, n, (shape, dtype) in zip(offsets, sizes, specs)]
