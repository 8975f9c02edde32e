"""Batched, seeded sampling with per-row parameters and the logprobs the RL step needs.

Randomness is a counter-based hash of (seed, output step, token id) turned into Gumbel noise, and a
token is drawn as argmax(logits / T + Gumbel) over the tokens that top-k / top-p / min-p keep —
exactly a draw from softmax(logits / T) restricted to that set. Because the noise depends only on
(seed, step, token), a sample's tokens do not depend on which other sequences share its batch, on
preemption and recompute, or on whether it was forked from a shared prompt: the property the n-sample
and preemption tests check. Logprobs: see `sampling_params` (temperature-scaled, before truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.layers import compile_fn
from ..models.transfer import as_device_tensor

_M32 = 0xFFFFFFFF
# multipliers below 2^31: inductor's Triton code types integer literals as int32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """An xorshift-multiply 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    return h ^ (h >> 16)


def token_keys(vocab: int, device) -> torch.Tensor:
    """A fixed random 32-bit key per token id (the same on every machine)."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(0, 2**32, (vocab,), generator=g, dtype=torch.int64).to(device)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """U(0,1) noise [B, V], a pure function of (seed, step, token id); keys = token_keys(V)."""
    s = _mix32((seeds & _M32) ^ _mix32((seeds >> 32) & _M32))
    row = _mix32((s * 0x297A2D39 + _mix32(steps & _M32) + 0x165667B1) & _M32)  # [B]
    h = _mix32(row[:, None] ^ keys[None, :])
    h = _mix32((h * 0x2545F491 + row[:, None]) & _M32)
    return (h.float() + 0.5) / 4294967296.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, built once per batch."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor  # [B] long, vocab size when disabled
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    seeds: torch.Tensor  # [B] long
    steps: torch.Tensor  # [B] long, index of the output token being drawn
    any_truncation: bool
    all_greedy: bool

    @classmethod
    def build(cls, rows: list[tuple], vocab: int, device) -> SamplingTensors:
        """rows: (temperature, top_k, top_p, min_p, seed, step) per sequence."""
        t, k, p, m, seed, step = zip(*rows)
        k = [vocab if x < 0 else min(x, vocab) for x in k]
        trunc = any(x < vocab for x in k) or any(x < 1.0 for x in p) or any(x > 0.0 for x in m)
        floats = as_device_tensor([t, p, m], device, torch.float32)  # pinned, no wait on a running step
        ints = as_device_tensor([k, seed, step], device, torch.int64)
        return cls(floats[0], ints[0], floats[1], floats[2], ints[1], ints[2], trunc, all(x == 0 for x in t))


def keep_mask(logprobs, top_k, top_p, min_p) -> torch.Tensor:
    """Which tokens top-k / top-p / min-p allow, [B, V] bool (computed on temperature-scaled probs)."""
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    keep = rank < top_k[:, None]
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    keep &= before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def _sample(logits, keys, temperature, top_k, top_p, min_p, seeds, steps, truncation: bool, all_greedy: bool):
    logits = logits.float()
    greedy = temperature == 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logprobs = torch.log_softmax(logits / temp[:, None], dim=-1)
    scores = logprobs
    if truncation:
        scores = scores.masked_fill(~keep_mask(logprobs, top_k, top_p, min_p), float("-inf"))
    if all_greedy:
        tokens = scores.argmax(-1)
    else:
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, keys)))
        tokens = (scores + torch.where(greedy[:, None], torch.zeros_like(gumbel), gumbel)).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class Sampler:
    """`sampler(logits [B, V], st) -> (tokens [B] long, logprobs [B] fp32)`. On GPU the whole draw
    (scale, log-softmax, hash noise, argmax) is compiled into a few fused kernels: unfused, the
    int64 hash alone would move ~8 GB per step at B=256 over a 152K vocabulary."""

    def __init__(self, compile: bool = False):
        # automatic-dynamic (`compile_fn`): the vocabulary size stays a constant in the generated
        # kernels' index math, only the batch size becomes symbolic once it changes
        self._fn = compile_fn(_sample) if compile else _sample
        self._keys: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        V = logits.shape[-1]
        if self._keys is None or self._keys.shape[0] != V or self._keys.device != logits.device:
            self._keys = token_keys(V, logits.device)
        return self._fn(logits, self._keys, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps,
                        st.any_truncation, st.all_greedy)


sample = Sampler()
