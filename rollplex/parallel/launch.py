"""Process-group setup for processes started by torchrun (`python -m torch.distributed.run`).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process it starts;
`init_from_env` turns them into the default process group: NCCL with one GPU per process (the
process's LOCAL_RANK) on CUDA, gloo on CPU.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Process:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def init_from_env(device: str = "cpu") -> Process:
    """The default process group from torchrun's environment. device: "cpu" (gloo) or "cuda" (NCCL)."""
    missing = [k for k in ENV if k not in os.environ]
    if missing:
        raise ValueError(f"not started by torchrun (missing {', '.join(missing)}): launch with "
                         "`python -m torch.distributed.run --nproc-per-node N -m ...`")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    rank, world, local = (int(os.environ[k]) for k in ENV[:3])
    dev = torch.device("cpu")
    if device == "cuda":
        if local >= torch.cuda.device_count():
            raise ValueError(f"local rank {local} has no GPU ({torch.cuda.device_count()} visible)")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                                **({"device_id": dev} if device == "cuda" else {}))
    return Process(rank, world, local, dev)


def end_rank() -> None:
    """End a torchrun rank's process after its command returned cleanly (process groups destroyed, output
    written): the interpreter's own teardown can abort in torch's gloo threads ("terminate called without
    an active exception", exit code -6), which torchrun then reports as a failed rank. Outside a group of
    more than one rank it does nothing."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
