"""Host -> device copies that do not stall the GPU queue.

`tensor.to("cuda")` from ordinary (pageable) host memory makes the host wait until the stream has
drained (torch synchronizes so the source may be freed right after). In a training micro-batch that
wait throws away the host's run-ahead: the GPU finishes the previous backward, then idles while
Python launches the next (small-kernel) vision tower. Staging through pinned memory with
`non_blocking=True` keeps the copy in stream order without a wait; the caching host allocator keeps
the pinned buffer alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """t (any device) -> device, without a host<->device sync when t is in host memory. The copy is
    staged in a fresh pinned buffer, so the caller may change t right away (a host block table
    rewritten for the next step while this step's upload is still queued)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device, non_blocking=True)


def as_device_tensor(data, device, dtype=None) -> torch.Tensor:
    """torch.tensor(data, device=device) without the sync."""
    return to_device(torch.tensor(data, dtype=dtype), device)
