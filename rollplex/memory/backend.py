"""Region backends: where a tagged region's physical memory comes from and how it is returned.

Both backends give a region the same semantics, so every path above them runs in CI:

* allocations made inside `region(tag)` belong to the tag;
* `pause(tag)` returns the region's physical memory; tensors keep their addresses (CUDA graphs that
  captured them stay valid) but their contents are undefined until written again;
* `resume(tag)` maps memory back at the same addresses, contents still undefined (the manager
  restores what must survive from its own pinned CPU copies).

`TorchMemorySaverBackend` (CUDA) is torch-memory-saver in `hook_mode="torch"`: one CUDA MemPool per
tag through its pluggable allocator, pause/resume unmap and remap the physical pages behind fixed
virtual addresses. It exits the process on a double pause or a resume of an active tag, so the
manager checks region states before every call. At interpreter exit the region pools release their
blocks outside any `region()`, which the package (0.0.10, CUDA) reports as misuse and answers by ending
the process with status 1 after all work ran; `_let_exit_frees_through` marks the exiting thread as
inside a region so those frees reach the saver, which owns every block of the pools.

`AccountingBackend` (CPU, or CUDA without the package) records the storages allocated in a region
with a dispatch mode and *poisons* them on pause (NaN bytes), so a test that reads a released region
sees garbage exactly as it would on the GPU. With `capacity` set it also plays a device of that size:
`free_bytes` and resume checks follow the regions' bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain(tree) -> list[torch.Tensor]:
    """The plain tensors of a pytree, with tensor subclasses that wrap others (DTensor: its local
    shard) opened up: the wrapper itself owns no storage."""
    out = []
    for t in tree_leaves(tree):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if is_traceable_wrapper_subclass(t):
            out.extend(_plain([getattr(t, name) for name in t.__tensor_flatten__()[0]]))
        else:
            out.append(t)
    return out


class _Capture(TorchDispatchMode):
    """Hands every storage that an op allocates (not a view or an in-place result) to `sink`."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in _plain((args, kwargs))}
        for t in _plain(out):
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                self.sink(st)
        return out


class AccountingBackend:
    name = "accounting"

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self._storages: dict[str, dict[int, weakref.ref]] = {}

    @contextlib.contextmanager
    def region(self, tag: str):
        live = self._storages.setdefault(tag, {})

        def sink(st):
            live[id(st)] = weakref.ref(st)

        with _Capture(sink):
            yield

    def _live(self, tag: str) -> list:
        live = self._storages.get(tag, {})
        out = []
        for k, ref in list(live.items()):
            st = ref()
            if st is None:
                del live[k]
            else:
                out.append(st)
        return out

    def region_bytes(self, tag: str) -> int:
        return sum(st.nbytes() for st in self._live(tag))

    def pause(self, tag: str) -> None:
        for st in self._live(tag):
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).fill_(0xFF)

    def resume(self, tag: str) -> None:
        pass

    def free_bytes(self, paused: set[str] = frozenset()) -> int:
        if self.capacity is None:
            return 1 << 62
        used = sum(self.region_bytes(t) for t in self._storages if t not in paused)
        return self.capacity - used

    def synchronize(self) -> None:
        pass


class TorchMemorySaverBackend:
    name = "torch-memory-saver"

    def __init__(self, device: torch.device):
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as e:
            raise ImportError("the phase-aware memory manager on CUDA needs torch-memory-saver>=0.0.10: "
                              "pip install 'rollplex[gpu]' (or use the accounting backend)") from e
        self.tms = torch_memory_saver
        try:
            self.tms.hook_mode = "torch"
        except (AssertionError, AttributeError):
            pass  # already initialised (one saver per process, e.g. a second manager): its hook mode stands
        self.device = device
        self._bytes: dict[str, int] = {}
        atexit.unregister(_let_exit_frees_through)  # one hook per process, however many backends
        atexit.register(_let_exit_frees_through, self.tms)

    @contextlib.contextmanager
    def region(self, tag: str):
        free0 = torch.cuda.mem_get_info(self.device)[0]
        with self.tms.region(tag=tag):
            yield
        torch.cuda.synchronize(self.device)
        # bytes the region's pool mapped while we were inside (the pool also caches freed blocks)
        self._bytes[tag] = self._bytes.get(tag, 0) + max(0, free0 - torch.cuda.mem_get_info(self.device)[0])

    def region_bytes(self, tag: str) -> int:
        return self._bytes.get(tag, 0)

    def pause(self, tag: str) -> None:
        torch.cuda.synchronize(self.device)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        self.tms.pause(tag)
        torch.cuda.synchronize(self.device)
        self._bytes[tag] = max(self._bytes.get(tag, 0), torch.cuda.mem_get_info(self.device)[0] - free0)

    def resume(self, tag: str) -> None:
        self.tms.resume(tag)

    def free_bytes(self, paused: set[str] = frozenset()) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def _let_exit_frees_through(tms) -> None:
    """Runs at exit (atexit, on the main thread, before module teardown frees the pools' tensors).
    The package frees pool blocks through `tms_torch_free`, which requires the calling thread to be
    inside a region; its own exit hook (HIP and XPU only) clears the pools early instead."""
    impl = getattr(tms, "_impl", None)  # None: no region was ever entered, nothing to free
    cdll = getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)
    if cdll is not None and hasattr(cdll, "tms_set_interesting_region"):
        cdll.tms_set_interesting_region(True)


def make_backend(kind: str, device: torch.device, capacity: int | None = None):
    """kind: 'auto' (torch-memory-saver on CUDA when installed, else accounting), 'tms' or 'accounting'."""
    if kind not in ("auto", "tms", "accounting"):
        raise ValueError(f"memory backend must be auto, tms or accounting, got {kind!r}")
    if kind == "accounting" or device.type != "cuda":
        if kind == "tms":
            raise ValueError("the torch-memory-saver backend needs a CUDA device")
        return AccountingBackend(capacity)
    if kind == "auto":
        try:
            return TorchMemorySaverBackend(device)
        except ImportError:
            return AccountingBackend(capacity)
    return TorchMemorySaverBackend(device)
