"""Objects holding tensors, passed between processes on one host through a file or as bytes.

CUDA tensors travel as CUDA IPC handles (torch.multiprocessing's `reduce_tensor`, what SGLang's own
weight updates use): the receiver maps the sender's memory, nothing is copied, and the sender must keep
the tensors alive until the receiver is done with them. Everything else (CPU tensors, dataclasses,
lists) is pickled by value — never through a shared-memory file descriptor, which only processes of
one multiprocessing family can fetch from each other. `dumps(obj)` is also the payload SGLang's weight
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
from torch.multiprocessing.reductions import reduce_tensor


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            return reduce_tensor(obj.detach())
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
