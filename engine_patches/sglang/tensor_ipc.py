"""Objects holding tensors, passed between processes on one host through a file or as bytes.

CUDA tensors travel as CUDA IPC handles (torch.multiprocessing's `reduce_tensor`, what SGLang's own
weight updates use): the receiver maps the sender's memory, nothing is copied, and the sender must keep
the tensors alive until the receiver is done with them. Everything else (CPU tensors, dataclasses,
lists) is pickled by value — never through a shared-memory file descriptor, which only processes of
one multiprocessing family can fetch from each other. SGLang's processes replace torch's reduce/rebuild
pair with one that names the device by its UUID (`sglang.srt.utils.patch_torch`); a tensor they send
would then load only where sglang is importable, so there it travels with this module's rebuild instead
(the device named by UUID, mapped back to an index by the receiver). `dumps(obj)` is also the payload SGLang's weight
update takes (its MultiprocessingSerializer is a ForkingPickler dump: CUDA tensors by the same
reduce_tensor). Only for data this runtime writes itself: loading runs pickle.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the rebuild functions pickle.load needs
from torch.multiprocessing import reductions

_DEVICE = 6  # the device's place in reduce_tensor's arguments for a CUDA tensor (the same since torch 1.x)


def _reduce_cuda(t: torch.Tensor) -> tuple:
    """(rebuild, args) of a CUDA tensor, loadable in any process of this host."""
    original = getattr(reductions, "_reduce_tensor_original", None)  # set where SGLang patched torch
    if original is None:
        return reductions.reduce_tensor(t)
    _, args = original(t)
    if not isinstance(args[_DEVICE], int):
        raise TypeError(f"unexpected reduce_tensor arguments for a CUDA tensor: {args[_DEVICE]!r} at {_DEVICE}")
    uuid = str(torch.cuda.get_device_properties(args[_DEVICE]).uuid)
    return _rebuild_cuda, (*args[:_DEVICE], uuid, *args[_DEVICE + 1:])


def _device_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"no visible CUDA device has UUID {uuid} (the sender's CUDA_VISIBLE_DEVICES differs)")


def _rebuild_cuda(*args):
    """The receiving side of `_reduce_cuda`: torch's own rebuild with the device as an index here."""
    dev = args[_DEVICE]
    if isinstance(dev, str):
        dev = _device_index(dev)
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return rebuild(*args[:_DEVICE], dev, *args[_DEVICE + 1:])


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return _reduce_cuda(obj.detach())
        return NotImplemented


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def dump(obj: Any, path: str | os.PathLike) -> None:
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> Any:
    with open(path, "rb") as f:
        return pickle.load(f)
