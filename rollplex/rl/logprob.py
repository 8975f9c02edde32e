"""Logprobs of target tokens straight from hidden states, without materialising [T, V] logits.

    logp[t] = (h_t . w_{y_t}) / T  -  logsumexp_v (h_t . w_v) / T

computed over chunks of tokens; the backward recomputes each chunk's logits and applies
d logp / d logits = (onehot(y) - softmax) / T, accumulating the head's gradient in fp32. Peak memory
is one [chunk, V] block instead of the [N, R, V] logits, log-softmax and their gradients (several GB
per micro-batch at Qwen's 152K vocabulary). Same values and gradients as log_softmax + gather (the
tests hold it); the logits GEMM runs in the weights' dtype, as `model.logits` does.

`token_logprob_entropy` also returns each token's entropy, H = -sum_v p_v log p_v with p = softmax(z),
from the same chunk logits (no second GEMM): a detached metric, for when no loss term needs its
gradient (an entropy bonus does: it goes through the full logits, rl/scoring.py).
"""

from __future__ import annotations

import functools

import torch

from ..models.layers import compile_fn


def _chunk_fwd(logits, targets, temperature: float):
    """logits [c, V] (weights' dtype) -> (logp of targets [c], logsumexp [c]) in fp32."""
    z = logits.float() / temperature
    lse = z.logsumexp(-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse


def _chunk_fwd_entropy(logits, targets, temperature: float):
    """As `_chunk_fwd`, plus the entropy of softmax(logits / T) per token [c] (fp32)."""
    z = logits.float() / temperature
    lse = z.logsumexp(-1)
    lz = z - lse[:, None]  # log-probabilities: -sum p log p has no cancellation, unlike lse - sum p z
    ent = -(lz.exp() * lz).sum(-1)
    return z.gather(-1, targets[:, None]).squeeze(-1) - lse, lse, ent


def _chunk_bwd(logits, lse, go, targets, temperature: float):
    """d loss / d logits of one chunk, in the logits' dtype: (onehot(y) - softmax) * go / T."""
    probs = (logits.float() / temperature - lse[:, None]).exp()
    g = -probs * go[:, None]
    g.scatter_add_(-1, targets[:, None], go[:, None])
    return (g / temperature).to(logits.dtype)


@functools.cache
def _chunk_fns(cuda: bool):
    """(forward, forward with entropy, backward) of one chunk. On GPU the chunk math is one fused pass
    over the [c, V] logits instead of ~6 (torch.compile)."""
    if not cuda:
        return _chunk_fwd, _chunk_fwd_entropy, _chunk_bwd
    return compile_fn(_chunk_fwd), compile_fn(_chunk_fwd_entropy), compile_fn(_chunk_bwd)


class _TokenLogprob(torch.autograd.Function):
    """(logprobs [T], entropies [T] or an empty tensor); the entropies carry no gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, entropy: bool):
        T = hidden.shape[0]
        out = torch.empty(T, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(T, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(T if entropy else 0, dtype=torch.float32, device=hidden.device)
        fwd, fwd_ent, _ = _chunk_fns(hidden.is_cuda)
        for s in range(0, T, chunk):
            logits, y = hidden[s : s + chunk] @ weight.t(), targets[s : s + chunk]
            if entropy:
                out[s : s + chunk], lse[s : s + chunk], ent[s : s + chunk] = fwd_ent(logits, y, temperature)
            else:
                out[s : s + chunk], lse[s : s + chunk] = fwd(logits, y, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        bwd = _chunk_fns(hidden.is_cuda)[2]
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = bwd(h @ weight.t(), lse[s : s + chunk], grad_out[s : s + chunk].float(), targets[s : s + chunk], t)
            if grad_h is not None:
                grad_h[s : s + chunk] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ h).float()
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def token_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk: int = 1024) -> torch.Tensor:
    """hidden [..., C], weight [V, C] (the LM head), targets [...] -> fp32 logprobs [...]."""
    shape = targets.shape
    out, _ = _TokenLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                 float(temperature), chunk, False)
    return out.view(shape)


def token_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          temperature: float = 1.0, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """As `token_logprob`, plus the entropy of each token's distribution softmax(logits / T) [...]
    (fp32, detached: a metric), from the same chunks."""
    shape = targets.shape
    out, ent = _TokenLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                   float(temperature), chunk, True)
    return out.view(shape), ent.view(shape)
