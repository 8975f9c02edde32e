"""Lossless speculative decoding for the rollout's tail: drafts from siblings, verified by the policy.

In the tail of a rollout a few sequences decode one token per step on an otherwise idle GPU. While
`Speculator.active` says so (speculation on, no request waiting, few sequences decoding), the engine
replaces a decode step by a *verification* step:

1. drafts: up to k tokens per sequence from `SuffixDrafter` (engine/drafter.py) over the request's
   samples — finished or still decoding — and, with the prompt cache, earlier responses to the prompt
   (the samples' tokens are counted ahead, in the time the host waits for plain decode steps, `prepare`,
   and while the GPU runs the previous verification, `index`);
2. one pass of the policy over each sequence's last token + its draft (`ModelRunner.verify`: each
   token a row over the paged KV, causal within the draft; their K/V written to the cache; the
   attention reads a sequence's K/V once for all its rows, `paged_verify_attention`);
3. the rule below picks the tokens to keep; the K/V of the rest is rolled back (`BlockManager.trim`:
   blocks past the kept tokens are freed, slots inside a kept block lie past the sequence's length).

Drafts that fail back it off: after a verification that accepted fewer than `speculative_min_accepted`
draft tokens per sequence, decode steps run the plain overlapped path, and drafting goes on *in shadow*
(`shadow`): at each plain step a few sequences get a draft from the tokens known then, and the tokens
plain decoding then appends score it — the leading tokens it matches are exactly what a verification
would have accepted (with the engine's coupled noise a verification keeps the tokens plain decoding
draws; unseeded, the same in distribution). Verification resumes once the latest shadow drafts accept
enough, and costs nothing on the GPU until then: drafts that never match cost one verification per
tail, not a probe every few steps. With `speculative_adaptive` the bar rises to what a verification
costs, from the tail's measured step times (a pass keeping 1 + a tokens per sequence pays when it takes
less than 1 + a decode steps). Which steps verify never changes the tokens (below), only the time.

The rule (`exact_rule`). Row j of a sequence (its last token + draft[:j] as input) gives the policy's
distribution p_j for output token t + j. Sampling row j with the engine's own sampler — the Gumbel-max
draw seeded by (seed, t + j), over the temperature-scaled, top-k/top-p/min-p-processed distribution
— gives x_j ~ p_j. Draft token j is accepted iff x_j == draft[j]; the first x_j that differs is kept
as the correction, and if all k are accepted x_k is the bonus token. This is speculative rejection
sampling against a point-mass draft (Leviathan et al. 2023; Chen et al. 2023) realised with coupled
noise: P(accept draft[j]) = P(x_j = draft[j]) = p_j(draft[j]), and given a rejection x_j is a draw
from p_j with draft[j] removed and the rest renormalised, the residual distribution. So every kept
token is distributed exactly as the policy's, and more: with the same noise the kept tokens *are*
the ones plain decoding would draw, so a seeded request gives the same sample with speculation on or
off (and under greedy decoding, accepting while the argmax matches, the same tokens). Logprobs are
the sampler's for the kept tokens: the policy's, as without speculation.

`rule` is an attribute so the tests can put a deliberately biased rule in its place and show that
their statistic rejects it.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields, replace

import torch

from .config import EngineConfig
from .drafter import DrafterConfig, SuffixDrafter
from .sampler import Sampler, SamplingTensors
from .sequence import Request, Sequence

# rule(sampler, logits [R, V], st [R] rows, drafts) -> per sequence (kept tokens, their logprobs); the
# rows of sequence i are its len(drafts[i]) + 1 rows, in order
Rule = Callable[[Sampler, torch.Tensor, SamplingTensors, list[list[int]]], list[tuple[list[int], list[float]]]]


def accepted(sampled: list[int], draft: list[int]) -> int:
    """How many leading draft tokens the policy's own draws (row by row) accept."""
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a


def exact_rule(sampler: Sampler, logits: torch.Tensor, st: SamplingTensors,
               drafts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Speculative rejection sampling against point-mass drafts (module docstring): the kept tokens
    are the accepted draft and then the first draw that differs (or the bonus draw)."""
    tokens, logprobs = sampler(logits, st)
    tokens, logprobs = tokens.tolist(), logprobs.tolist()
    out, r = [], 0
    for d in drafts:
        a = accepted(tokens[r : r + len(d)], d)
        out.append((tokens[r : r + a + 1], logprobs[r : r + a + 1]))
        r += len(d) + 1
    return out


@dataclass
class SpecStats:
    steps: int = 0  # verification passes
    seq_steps: int = 0  # sequences verified, summed over passes
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens kept (accepted + one correction or bonus per sequence and pass)
    shadow_drafts: int = 0  # drafts scored in shadow (backed off: against the tokens plain decoding drew)
    shadow_accepted: int = 0  # of their tokens, those a verification would have accepted
    wall_ms: float = 0.0  # verification steps' host wall time, summed
    forward_ms: float = 0.0  # of it, the passes' GPU time (CUDA events; on CPU the pass's wall time)

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per sequence and pass."""
        return self.accepted / max(self.seq_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Draft tokens accepted per draft token proposed."""
        return self.accepted / max(self.drafted, 1)

    def copy(self) -> SpecStats:
        return replace(self)

    def since(self, earlier: SpecStats) -> SpecStats:
        """The counts added after `earlier` (a `copy` taken then)."""
        return SpecStats(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seq_steps": self.seq_steps, "drafted": self.drafted,
                "accepted": self.accepted, "emitted": self.emitted, "mean_accepted": self.mean_accepted,
                "acceptance_rate": self.acceptance_rate, "shadow_drafts": self.shadow_drafts,
                "shadow_accepted": self.shadow_accepted, "wall_ms": self.wall_ms, "forward_ms": self.forward_ms}


def prompt_key(req: Request) -> Hashable:
    """What identifies a request's prompt for the prompt cache: its token ids and its pixels."""
    parts = [tuple(req.inputs.input_ids)]
    for t in (getattr(req.inputs, "pixel_values", None), getattr(req.inputs, "pixel_values_videos", None)):
        if t is not None:
            raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy()
            parts.append(hashlib.blake2b(raw.tobytes(), digest_size=16).hexdigest())
    return tuple(parts)


class Speculator:
    """The engine's speculation state: when to speculate, the drafter, the rule, the counts."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.k = cfg.speculative_tokens
        self.drafter = SuffixDrafter(DrafterConfig(max_ngram=cfg.speculative_ngram,
                                                   cache_prompts=cfg.speculative_prompt_cache))
        self.rule: Rule = exact_rule
        self.stats = SpecStats()
        self.peak = 0  # the most sequences decoding at once since the engine last had none running
        self.skip = 0  # decode steps left to run plain (the adaptive back-off's timing steps)
        self.backed_off = False  # a verification accepted too little: plain steps until shadow drafts pay
        self._shadow: dict[int, tuple[Sequence, int, list[int]]] = {}  # id(seq) -> (seq, first position, draft)
        self._scores: deque[int] = deque(maxlen=self.SHADOW_WINDOW)  # accepted tokens of the latest shadow drafts
        self.in_tail = False  # whether the last active() call found the batch small enough to speculate
        self.verify_ms = self.decode_ms = None  # moving averages of the tail's step times (adaptive back-off)
        self.probed = False  # the adaptive back-off's first tail ran plain decode steps to time one
        self._cursor = 0  # where `prepare` goes on

    EMA = 0.25  # weight of the newest step time in the moving averages
    SHADOW_WINDOW = 16  # the latest shadow drafts the decision to verify again reads
    SHADOW_PER_STEP = 16  # sequences drafted in shadow per plain step (host work: a few µs each)

    def active(self, running: int, waiting: int) -> bool:
        """Whether the next decode step verifies drafts (called once per engine step)."""
        if running == 0:  # a rollout ended (or has not begun): the next tail starts afresh
            self.peak, self.skip = 0, 0  # a back-off is about one tail's drafts, not the next's
            self._back_off(False)
            return False
        self.peak = max(self.peak, running)
        self.in_tail = not (waiting or running > self.cfg.speculative_max_batch
                            or running > self.cfg.speculative_max_fraction * self.peak)
        if not self.in_tail:
            return False
        if self.cfg.speculative_adaptive and self.decode_ms is None and not self.probed:
            self.probed, self.skip = True, max(self.skip, 2)  # a period needs two consecutive decode steps
        if self.skip:
            self.skip -= 1
            return False
        return not self.backed_off

    def drafts(self, seqs: list[Sequence], open_requests) -> list[list[int]]:
        """Up to k draft tokens per sequence for its positions from len(seq) on (never past its request's
        length limit; a token still in flight is drafted past, as `shadow` needs), from what `index` has
        counted (a request seen for the first time is indexed here first)."""
        self.drafter.retain(open_requests)  # requests that left the engine
        out = []
        for s in seqs:
            req = s.request
            rid = req.request_id
            if self._open(req):
                self._index(req)
            k = min(self.k, req.max_len - len(s) - 1)
            d = self.drafter.propose(rid, s.token_ids, k + s.pending, s.num_prompt_tokens) if k > 0 else []
            out.append(d[s.pending :])
        return out

    def shadow(self, seqs: list[Sequence], open_requests) -> None:
        """Backed off, at a plain decode step: score the shadow drafts whose outcome the tokens appended
        since tell, draft for a few more of `seqs` (those without one outstanding), and end the back-off
        once the latest `SHADOW_WINDOW` scores (at least one per sequence decoding, up to that) reach the
        bar. A draft made here is for the positions past the token in flight, as a verification's would be."""
        if not (self.backed_off and self.in_tail):
            return
        for key, (s, start, draft) in list(self._shadow.items()):
            got = s.token_ids[start : start + len(draft)]
            a = accepted(got, draft[: len(got)])
            if a == len(got) < len(draft) and not s.finished:
                continue  # every token so far matches and more are coming
            del self._shadow[key]
            self._scores.append(a)
            self.stats.shadow_drafts += 1
            self.stats.shadow_accepted += a
        need = min(self.SHADOW_WINDOW, len(seqs))
        if len(self._scores) >= need and sum(self._scores) >= self.min_accepted() * len(self._scores):
            self._back_off(False)
            return
        fresh = [s for s in seqs if id(s) not in self._shadow and not s.finished][: self.SHADOW_PER_STEP]
        if fresh:
            for s, d in zip(fresh, self.drafts(fresh, open_requests)):
                self._shadow[id(s)] = (s, len(s), list(d))

    def _back_off(self, on: bool) -> None:
        """Enter (or leave) the backed-off state; its shadow drafts and scores start afresh either way."""
        self.backed_off = on
        self._shadow.clear()
        self._scores.clear()

    def index(self, seqs: list[Sequence]) -> None:
        """Count the tokens the requests of `seqs` have drawn since the last call, for the next drafts. The
        engine calls it once the verification pass is launched, so the host does it while the GPU runs; the
        next drafts then miss only the tokens that pass keeps (a draft never changes what is sampled)."""
        done = set()
        for s in seqs:
            req = s.request
            if req.request_id not in done and req.request_id in self.drafter.groups:
                done.add(req.request_id)
                self._index(req)

    def prepare(self, seqs: list[Sequence], budget_ms: float) -> None:
        """Index ahead: open the groups of `seqs` and count their samples' tokens for at most `budget_ms`
        (the engine passes a share of the time its host waited for the last decode step). The first
        verification then finds its groups' texts counted instead of counting them all while the GPU idles
        (16 samples of ~800 tokens are ~13k tokens, each a dictionary update per n-gram length); where the
        budget runs out, the rest is counted as before. A draft never changes what is sampled."""
        if budget_ms <= 0 or not seqs:
            return
        deadline = time.perf_counter() + budget_ms / 1e3
        first = self._cursor % len(seqs)  # start where the last call stopped: every group gets its turn
        done = set()
        for j in range(len(seqs)):
            req = seqs[(first + j) % len(seqs)].request
            if req.request_id in done:
                continue
            done.add(req.request_id)
            self._open(req)
            if not self._index(req, deadline):
                self._cursor = first + j + 1  # the next call starts at the next request
                return

    def _open(self, req: Request) -> bool:
        """Open the request's group unless it is open; whether it was opened now."""
        if req.request_id in self.drafter.groups:
            return False
        self.drafter.open(req.request_id, req.inputs.input_ids, self._key(req))
        return True

    def _index(self, req: Request, deadline: float | None = None) -> bool:
        """Count the request's samples' new tokens; False where `deadline` (perf_counter s) passed after a
        sample that had new tokens (a caught-up sample costs nothing, so a tiny budget still moves on)."""
        for sib in req.seqs:
            new = self.drafter.extend(req.request_id, sib.sample_index, sib.token_ids, sib.num_prompt_tokens)
            if new and deadline is not None and time.perf_counter() > deadline:
                return False
        return True

    def finish(self, req: Request) -> None:
        """A request left the engine finished: its responses go to the prompt cache (when on)."""
        self.drafter.close(req.request_id)
        if self.cfg.speculative_prompt_cache:
            self.drafter.remember(req.inputs.input_ids, [s.output_ids for s in req.seqs], self._key(req))

    def _key(self, req: Request) -> Hashable | None:
        return prompt_key(req) if self.cfg.speculative_prompt_cache else None

    def note_step(self, ms: float | None, verify: bool) -> None:
        """A tail step's wall time (a verification, or a plain decode step's period), for the adaptive back-off."""
        if ms is None or not self.in_tail:
            return
        old = self.verify_ms if verify else self.decode_ms
        new = ms if old is None else old + self.EMA * (ms - old)
        if verify:
            self.verify_ms = new
        else:
            self.decode_ms = new

    def min_accepted(self) -> float:
        """Accepted draft tokens per sequence below which a verification backs speculation off."""
        floor = self.cfg.speculative_min_accepted
        if not self.cfg.speculative_adaptive or self.verify_ms is None or not self.decode_ms:
            return floor
        return max(floor, self.verify_ms / self.decode_ms - 1.0)  # (1 + a) tokens per pass vs 1 per decode step

    def count(self, drafts: list[list[int]], kept: list[int]) -> None:
        """Count a verification; back off (plain steps, drafting in shadow) when it accepted too little."""
        if sum(kept) - len(kept) < self.min_accepted() * len(kept):
            self._back_off(True)
        self.stats.steps += 1
        self.stats.seq_steps += len(drafts)
        self.stats.drafted += sum(len(d) for d in drafts)
        self.stats.emitted += sum(kept)
        self.stats.accepted += sum(n - 1 for n in kept)
