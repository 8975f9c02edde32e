"""Attention kernels the model calls, with their metadata passed explicitly (no global context).

* `Segments` + `segment_attention`: bidirectional attention inside many variable-length segments
  of one packed sequence (the vision tower's windows and frames) in ONE call. On CUDA it uses
  torch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`); elsewhere, or when that is
  missing, it gathers the segments into a padded [S, Lmax] batch and runs one masked SDPA.
  transformers loops over windows in Python instead — that loop is why its ViT is slow.
* `sdpa`: SDPA over [B, H, L, D] queries and [B, Hkv, S, D] keys/values with grouped-query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:  # torch >= 2.9 (CUDA only at run time)
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


@dataclass
class Segments:
    """Boundaries of variable-length segments in a packed sequence; padded layout built lazily."""

    cu_seqlens: list[int]
    device: torch.device
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def max_len(self) -> int:
        return max(b - a for a, b in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:]))

    def cu_tensor(self) -> torch.Tensor:
        if "cu" not in self._cache:
            self._cache["cu"] = torch.tensor(self.cu_seqlens, dtype=torch.int32, device=self.device)
        return self._cache["cu"]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index [S, Lmax] into the packed tokens (pads point at 0), key mask [S, 1, 1, Lmax], valid [S, Lmax])."""
        if "pad" not in self._cache:
            cu = torch.tensor(self.cu_seqlens, dtype=torch.long)
            lens = cu[1:] - cu[:-1]
            ar = torch.arange(self.max_len)
            valid = ar[None, :] < lens[:, None]
            index = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros((), dtype=torch.long))
            valid = valid.to(self.device)
            self._cache["pad"] = (index.to(self.device), valid[:, None, None, :], valid)
        return self._cache["pad"]


def _use_flash_varlen(q: torch.Tensor) -> bool:
    return _varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, backend: str = "auto"
) -> torch.Tensor:
    """Bidirectional attention within segments. q, k, v: [T, H, D] packed -> [T, H, D].

    backend: "auto" (flash varlen on CUDA in half precision, else padded SDPA) or "sdpa".
    """
    if backend == "auto" and _use_flash_varlen(q):
        cu, m = seg.cu_tensor(), seg.max_len
        return _varlen_attn(q, k, v, cu, cu, m, m)
    index, key_mask, valid = seg.padded()
    qp, kp, vp = (t[index].transpose(1, 2) for t in (q, k, v))  # [S, H, Lmax, D]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=key_mask)
    return out.transpose(1, 2)[valid]  # padded rows dropped; order of `valid` is packed order


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """q [B, H, L, D]; k, v [B, Hkv, S, D]; mask broadcastable to [B, H, L, S] (True = attend)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
