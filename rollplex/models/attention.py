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
from functools import lru_cache

import torch
import torch.nn.functional as F

from .transfer import as_device_tensor, to_device

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
            self._cache["cu"] = as_device_tensor(self.cu_seqlens, self.device, torch.int32)
        return self._cache["cu"]

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index [S, Lmax] into the packed tokens (pads point at 0), key mask [S, 1, 1, Lmax], valid [S, Lmax])."""
        if "pad" not in self._cache:
            cu = torch.tensor(self.cu_seqlens, dtype=torch.long)
            lens = cu[1:] - cu[:-1]
            ar = torch.arange(self.max_len)
            valid = ar[None, :] < lens[:, None]
            index = torch.where(valid, cu[:-1, None] + ar[None, :], torch.zeros((), dtype=torch.long))
            valid = to_device(valid, self.device)
            self._cache["pad"] = (to_device(index, self.device), valid[:, None, None, :], valid)
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


@dataclass
class SharedPrefixLayout:
    """Which prefix each response attends to: response i (Rin tokens, right-padded) sees the first
    lens[i] keys of prefix row index[i], then its own tokens causally."""

    index: torch.Tensor  # [N] long
    lens: torch.Tensor  # [N] long: prefix length of each response's prompt
    num_prefix_rows: int
    prefix_max: int
    response_len: int
    _cache: dict = field(default_factory=dict, repr=False)

    def mask(self) -> torch.Tensor:
        """[N, 1, Rin, Pmax + Rin] bool (True = attend) for the padded SDPA path."""
        if "mask" not in self._cache:
            N, Rin, Pmax, dev = self.index.shape[0], self.response_len, self.prefix_max, self.index.device
            prefix_ok = torch.arange(Pmax, device=dev)[None, :] < self.lens[:, None]
            causal = torch.ones(Rin, Rin, dtype=torch.bool, device=dev).tril()
            m = torch.cat([prefix_ok[:, None, :].expand(N, Rin, Pmax), causal.expand(N, Rin, Rin)], dim=-1)
            self._cache["mask"] = m[:, None]
        return self._cache["mask"]

    def packed(self):
        """(key gather index into cat(prefix rows, responses), cu_q, cu_k, max_k) for varlen flash."""
        if "packed" not in self._cache:
            dev, N, Rin, Pmax = self.index.device, self.index.shape[0], self.response_len, self.prefix_max
            lens = self.lens.cpu()
            starts = self.index.cpu() * Pmax
            seg = lens + Rin
            within = torch.arange(int(seg.sum())) - torch.repeat_interleave(torch.cumsum(seg, 0) - seg, seg)
            owner = torch.repeat_interleave(torch.arange(N), seg)
            in_prefix = within < lens[owner]
            resp_base = self.num_prefix_rows * Pmax + owner * Rin
            gather = torch.where(in_prefix, starts[owner] + within, resp_base + within - lens[owner])
            cu_q = torch.arange(N + 1, dtype=torch.int32) * Rin
            cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(seg, 0).to(torch.int32)])
            self._cache["packed"] = (to_device(gather, dev), to_device(cu_q, dev), to_device(cu_k, dev), int(seg.max()))
        return self._cache["packed"]


def _varlen_causal(q, k, v, cu_q, cu_k, max_q, max_k):
    """Causal varlen flash attention, bottom-right aligned (query j of a segment sees keys up to
    j + len_k - len_q), with GQA; across torch versions' signatures of varlen_attn."""
    params = _varlen_kwargs_names()
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif not varlen_native_gqa_ok(str(q.device), q.dtype):
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


@lru_cache(maxsize=8)
def varlen_native_gqa_ok(device: str, dtype: torch.dtype) -> bool:
    """Capability probe for torch versions whose varlen_attn has no `enable_gqa` flag: does the flash
    kernel behind it take fewer key/value heads than query heads, forward and backward? Then the
    keys/values are not repeated per query head (8x their memory at Qwen's 16/2 heads, saved for the
    backward of every layer)."""
    if _varlen_attn is None or not device.startswith("cuda"):
        return False
    try:
        with torch.enable_grad():
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(9, h, 64, device=device, dtype=dtype, generator=g).requires_grad_()
                       for h in (4, 2, 2))
            cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
            go = torch.randn(9, 4, 64, device=device, dtype=dtype, generator=g)
            kw = {"window_size": (-1, 0)} if "window_size" in _varlen_kwargs_names() else {"is_causal": True}
            outs = []
            for kk, vv in ((k, v), (k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))):
                out = _varlen_attn(q, kk, vv, cu, cu, 5, 5, **kw)
                outs.append([out, *torch.autograd.grad(out, (q, k, v), go)])
        return all(torch.allclose(a.float(), b.float(), atol=2e-2) for a, b in zip(*outs))
    except (RuntimeError, TypeError, ValueError):
        return False


@lru_cache(maxsize=8)
def varlen_bottom_right_ok(device: str, dtype: torch.dtype) -> bool:
    """Capability probe: does this torch's varlen flash attention do bottom-right causal masking?"""
    if _varlen_attn is None or not device.startswith("cuda"):
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(3, 2, 64, device=device, dtype=dtype, generator=g)
        k = torch.randn(7, 2, 64, device=device, dtype=dtype, generator=g)
        v = torch.randn(7, 2, 64, device=device, dtype=dtype, generator=g)
        cu_q = torch.tensor([0, 3], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 7], dtype=torch.int32, device=device)
        out = _varlen_causal(q, k, v, cu_q, cu_k, 3, 7)
        mask = torch.ones(3, 7, dtype=torch.bool, device=device).tril(diagonal=4)
        ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return bool(torch.allclose(out.float(), ref.transpose(0, 1).float(), atol=2e-2))
    except (RuntimeError, TypeError):
        return False


def shared_prefix_attention(q, k, v, pk, pv, layout: SharedPrefixLayout, backend: str = "auto") -> torch.Tensor:
    """Responses attending to shared prefixes. q [N, H, Rin, D]; k, v [N, Hkv, Rin, D];
    pk, pv [B, Hkv, Pmax, D] (one row per prompt) -> [N, H, Rin, D]. Gradients of all responses of a
    prompt accumulate into its one prefix row."""
    N, H, Rin, D = q.shape
    if backend == "auto" and _use_flash_varlen(q) and varlen_bottom_right_ok(str(q.device), q.dtype):
        gather, cu_q, cu_k, max_k = layout.packed()
        Hkv = k.shape[1]
        keys = torch.cat([pk.transpose(1, 2).reshape(-1, Hkv, D), k.transpose(1, 2).reshape(-1, Hkv, D)])
        vals = torch.cat([pv.transpose(1, 2).reshape(-1, Hkv, D), v.transpose(1, 2).reshape(-1, Hkv, D)])
        out = _varlen_causal(q.transpose(1, 2).reshape(N * Rin, H, D), keys[gather], vals[gather],
                             cu_q, cu_k, Rin, max_k)
        return out.view(N, Rin, H, D).transpose(1, 2)
    idx = layout.index
    return sdpa(q, torch.cat([pk[idx], k], dim=2), torch.cat([pv[idx], v], dim=2), mask=layout.mask())


def _varlen_meta(gather: list[torch.Tensor], cu_q: list[int], cu_k: list[int], dev) -> tuple:
    """(key gather index, cu_q, cu_k, max_q, max_k) on the device, from host-built segment lists."""
    lq = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lk = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    i32 = torch.int32
    return (to_device(torch.cat(gather), dev), as_device_tensor(cu_q, dev, i32), as_device_tensor(cu_k, dev, i32),
            max(lq), max(lk))


@dataclass
class PrefixPackedLayout:
    """Responses packed into one token sequence (no padding) attending to prefix rows computed
    earlier: response i (response_lens[i] input tokens) sees the first prefix_lens[i] keys of prefix
    row index[i], then its own tokens causally. The packed counterpart of SharedPrefixLayout."""

    index: list[int]  # [N] prefix row of each response
    prefix_lens: list[int]  # [N] prompt length of each response's prefix row
    num_prefix_rows: int
    prefix_max: int
    response_lens: list[int]  # [N] input tokens of each response (may be 0)
    device: torch.device
    _cache: dict = field(default_factory=dict, repr=False)

    def varlen(self):
        """(key gather index into cat(prefix rows flattened, packed responses), cu_q, cu_k, max_q, max_k)."""
        if "varlen" not in self._cache:
            gather, cu_q, cu_k, start = [], [0], [0], self.num_prefix_rows * self.prefix_max
            for g, p, n in zip(self.index, self.prefix_lens, self.response_lens):
                if n:
                    base = g * self.prefix_max
                    gather += [torch.arange(base, base + p), torch.arange(start, start + n)]
                    cu_q.append(cu_q[-1] + n)
                    cu_k.append(cu_k[-1] + p + n)
                start += n
            self._cache["varlen"] = _varlen_meta(gather, cu_q, cu_k, self.device)
        return self._cache["varlen"]

    def mask(self) -> torch.Tensor:
        """[1, 1, T, B * Pmax + T] bool (True = attend) for the dense SDPA path (CPU, small T)."""
        if "mask" not in self._cache:
            T, Kp = sum(self.response_lens), self.num_prefix_rows * self.prefix_max
            m = torch.zeros(T, Kp + T, dtype=torch.bool)
            s = 0
            for g, p, n in zip(self.index, self.prefix_lens, self.response_lens):
                m[s : s + n, g * self.prefix_max : g * self.prefix_max + p] = True
                m[s : s + n, Kp + s : Kp + s + n] = torch.ones(n, n, dtype=torch.bool).tril()
                s += n
            self._cache["mask"] = to_device(m[None, None], self.device)
        return self._cache["mask"]


def prefix_packed_attention(q, k, v, pk, pv, layout: PrefixPackedLayout, backend: str = "auto") -> torch.Tensor:
    """Packed responses over prefix rows. q [1, H, T, D]; k, v [1, Hkv, T, D]; pk, pv [B, Hkv, Pmax, D]
    -> [1, H, T, D]."""
    Hkv, D = k.shape[1], k.shape[3]
    keys = torch.cat([pk.transpose(1, 2).reshape(-1, Hkv, D), k[0].transpose(0, 1)])  # [B*Pmax + T, Hkv, D]
    vals = torch.cat([pv.transpose(1, 2).reshape(-1, Hkv, D), v[0].transpose(0, 1)])
    if backend == "auto" and _use_flash_varlen(q) and varlen_bottom_right_ok(str(q.device), q.dtype):
        gather, cu_q, cu_k, max_q, max_k = layout.varlen()
        out = _varlen_causal(q[0].transpose(0, 1).contiguous(), keys[gather], vals[gather], cu_q, cu_k, max_q, max_k)
        return out.transpose(0, 1)[None]
    return sdpa(q, keys.transpose(0, 1)[None], vals.transpose(0, 1)[None], mask=layout.mask())


@lru_cache(maxsize=1)
def _varlen_kwargs_names() -> frozenset:
    import inspect

    return frozenset(inspect.signature(_varlen_attn).parameters) if _varlen_attn is not None else frozenset()


@dataclass
class PackedLayout:
    """B prompts and N responses packed into ONE token sequence: [prompt 0 | ... | prompt B-1 |
    response 0 inputs | ... | response N-1 inputs]. Prompt b's tokens attend causally among
    themselves; response i's tokens attend to all of its prompt's tokens, then causally to its own.
    One varlen attention call per layer covers everything, and the prompt's keys computed in the same
    pass are what every response of its group reads (their gradients meet there)."""

    prompt_lens: list[int]  # [B]
    response_lens: list[int]  # [N] input tokens of each response (targets - 1; may be 0)
    group: list[int]  # [N] prompt of each response
    device: torch.device
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.prompt_starts = [0]
        for n in self.prompt_lens[:-1]:
            self.prompt_starts.append(self.prompt_starts[-1] + n)
        self.response_starts = [sum(self.prompt_lens)]
        for n in self.response_lens[:-1]:
            self.response_starts.append(self.response_starts[-1] + n)
        self.total = sum(self.prompt_lens) + sum(self.response_lens)
        # no response segments (whole sequences, `sequence_hidden`): every segment's keys are its own queries'
        self.keys_in_order = not any(self.response_lens)

    def segments(self):
        """(query rows start, length, key rows as (start, len) runs) of every non-empty segment."""
        for s, n in zip(self.prompt_starts, self.prompt_lens):
            yield s, n, [(s, n)]
        for s, n, g in zip(self.response_starts, self.response_lens, self.group):
            if n:
                yield s, n, [(self.prompt_starts[g], self.prompt_lens[g]), (s, n)]

    def varlen(self):
        """(key gather index, cu_q, cu_k, max_q, max_k) on the device, for flash varlen (bottom-right causal)."""
        if "varlen" not in self._cache:
            gather, cu_q, cu_k = [], [0], [0]
            for _, n, runs in self.segments():
                for a, m in runs:
                    gather.append(torch.arange(a, a + m))
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + sum(m for _, m in runs))
            self._cache["varlen"] = _varlen_meta(gather, cu_q, cu_k, self.device)
        return self._cache["varlen"]

    def mask(self) -> torch.Tensor:
        """[1, 1, T, T] bool (True = attend), for the dense SDPA path (CPU, small T)."""
        if "mask" not in self._cache:
            m = torch.zeros(self.total, self.total, dtype=torch.bool)
            for s, n, runs in self.segments():
                causal = torch.ones(n, n, dtype=torch.bool).tril()
                if len(runs) == 2:
                    a, p = runs[0]
                    m[s : s + n, a : a + p] = True
                m[s : s + n, s : s + n] = causal
            self._cache["mask"] = to_device(m[None, None], self.device)
        return self._cache["mask"]


def packed_attention(q, k, v, layout: PackedLayout, backend: str = "auto") -> torch.Tensor:
    """q [1, H, T, D]; k, v [1, Hkv, T, D] in packed order -> [1, H, T, D]."""
    _, H, T, D = q.shape
    if backend == "auto" and _use_flash_varlen(q) and varlen_bottom_right_ok(str(q.device), q.dtype):
        gather, cu_q, cu_k, max_q, max_k = layout.varlen()
        if layout.keys_in_order:  # the gather would be the identity: no copy through an index (nor its scatter)
            keys, vals = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()
        else:
            keys, vals = k[0].transpose(0, 1)[gather], v[0].transpose(0, 1)[gather]  # [Tk, Hkv, D]
        out = _varlen_causal(q[0].transpose(0, 1).contiguous(), keys, vals, cu_q, cu_k, max_q, max_k)
        return out.transpose(0, 1)[None]
    return sdpa(q, k, v, mask=layout.mask())
