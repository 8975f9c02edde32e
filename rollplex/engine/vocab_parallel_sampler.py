"""Sampling from a vocab-parallel LM head without gathering the logits.

A tensor-parallel rank's head gives logits for its rows of the vocabulary, [B, V/tp]. Gathering them
moves B x V values per decode step (156 MB at B = 256 over a 152K vocabulary in fp32) to draw one
token per row. The engine's draw (engine/sampler.py) is argmax(logprob + Gumbel(seed, step, token))
with noise that depends only on the token id, so it splits over vocabulary shards: each rank computes
its shard's log-softmax against the global log-sum-exp (two all-reduces of [B]), adds the noise of its
own token ids, and takes its local argmax; one all-gather of [3, B] (value, token, logprob) then picks
the winner on every rank, ties to the lower token id as a whole-vocabulary argmax would. The same
tokens, up to the rounding of a log-sum-exp taken in two levels (the logprobs agree to ~1e-7; a draw
could differ only where two tokens' scores tie to that precision).

Rows with top-k / top-p / min-p truncation need the sorted whole distribution: a batch with any of
them gathers the logits and runs the ordinary sampler.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sampler import Sampler, SamplingTensors, token_keys, uniform_noise


class VocabParallelSampler:
    """`sampler(local_logits [B, V/tp], st) -> (tokens [B] long, logprobs [B] fp32)`, the same on every
    rank of `tp` (see the module docstring); `fallback` samples gathered logits for truncated rows.
    tp: the engine's tensor-parallel plan (its `size`, `rank`, `group`, `gather_last`;
    rollplex.parallel.TPPlan), which the engine is given and never builds."""

    def __init__(self, tp, vocab: int, fallback: Sampler):
        if vocab % tp.size:
            raise ValueError(f"vocabulary {vocab} does not split over {tp.size} tensor-parallel ranks")
        self.tp, self.vocab, self.fallback = tp, vocab, fallback
        self.rows = vocab // tp.size
        self.start = tp.rank * self.rows
        self._keys: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        assert logits.shape[-1] == self.rows, (tuple(logits.shape), self.rows)
        if st.any_truncation:
            return self.fallback(self.tp.gather_last(logits), st)
        if self._keys is None or self._keys.device != logits.device:
            self._keys = token_keys(self.vocab, logits.device)[self.start : self.start + self.rows]
        group = self.tp.group
        greedy = st.temperature == 0
        temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
        x = logits.float() / temp[:, None]  # [B, V/tp]
        top = x.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        total = (x - top[:, None]).exp().sum(-1)
        dist.all_reduce(total, group=group)
        logprobs = x - (top + total.log())[:, None]
        scores = logprobs
        if not st.all_greedy:
            gumbel = -torch.log(-torch.log(uniform_noise(st.seeds, st.steps, self._keys)))
            scores = logprobs + torch.where(greedy[:, None], torch.zeros_like(gumbel), gumbel)
        best, idx = scores.max(-1)  # the first maximum in this shard
        mine = torch.stack([best, (idx + self.start).to(best.dtype), logprobs.gather(-1, idx[:, None]).squeeze(-1)])
        every = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(every, mine, group=group)
        every = torch.stack(every)  # [tp, 3, B]: shards in vocabulary order
        win = every[:, 0].argmax(0)  # the first rank holding the maximum: the lowest token id among ties
        pick = every.gather(0, win[None, None, :].expand(1, 3, -1))[0]
        return pick[1].round().long(), pick[2]
