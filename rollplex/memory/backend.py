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
manager checks region states before every call.

`AccountingBackend` (CPU, or CUDA without the package) records the storages allocated in a region
with a dispatch mode and *poisons* them on pause (NaN bytes), so a test that reads a released region
sees garbage exactly as it would on the GPU. With `capacity` set it also plays a device of that size:
`free_bytes` and resume checks follow the regions' bytes.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Capture(TorchDispatchMode):
    """Hands every storage that an op allocates (not a view or an in-place result) to `sink`."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
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
