"""Model-free drafts for speculative decoding: n-gram continuations from a group's siblings (no torch).

The n samples of a prompt answer the same question, and an RL rollout asks the same prompts again at
later steps, so the text a sequence is about to write has often been written already — by a sibling
(another sample of the same request, finished or still decoding), by the sequence itself, or by an
earlier response to the same prompt. `SuffixDrafter` keeps, per request (a *group*), counts of which
token followed each n-gram (n = 1 .. max_ngram) in those texts, and drafts a continuation greedily:
at each draft position it looks up the longest suffix of (context + draft so far) that has been seen,
and proposes the token that most often followed it, stopping when none was seen or the most frequent
continuation is rarer than `min_share` of that suffix's occurrences (SuffixDecoding / RhymeRL use the
same signal).

Texts are indexed as the last `max_ngram` prompt tokens followed by the output, so siblings share the
n-grams that start inside the prompt and a fresh sequence gets drafts from its first output token.
Indexing is incremental: `extend` only counts the n-grams that end at tokens it has not seen.

The optional prompt cache (`cache_prompts` > 0) keeps the outputs of the last `cache_prompts` prompts
(least recently used out) and seeds a new group of the same prompt with them. A draft never changes
what is sampled (the verifier keeps the policy's distribution), so a stale or colliding cache entry
costs only acceptance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterConfig:
    max_ngram: int = 6  # longest context matched
    min_ngram: int = 1  # shortest context matched (1: any token seen before)
    min_share: float = 0.0  # stop drafting where the best continuation has a smaller share of its context's count
    cache_prompts: int = 0  # prompts whose earlier responses seed new groups of the same prompt (0: off)
    cache_responses: int = 16  # responses kept per cached prompt (the most recent)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} / {self.max_ngram}")
        if self.max_ngram > 32:
            raise ValueError(f"max_ngram must be <= 32, got {self.max_ngram}")
        if not 0.0 <= self.min_share < 1.0:
            raise ValueError(f"min_share must be in [0, 1), got {self.min_share}")
        if self.cache_prompts < 0 or self.cache_responses < 1:
            raise ValueError("cache_prompts must be >= 0 and cache_responses >= 1")


def _by_count(kv: tuple[int, int]) -> tuple[int, int]:
    return kv[1], -kv[0]  # the most frequent continuation, ties to the smaller token


class _Group:
    """The n-gram continuation counts of one request's texts."""

    def __init__(self, cfg: DrafterConfig, head: list[int]):
        self.cfg, self.head = cfg, head
        # context tuple -> {next token: count}; one table for every n (tuples of different lengths differ)
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.seen: dict[Hashable, int] = {}  # member -> output tokens indexed so far

    def add_text(self, text: Sequence[int], start: int) -> None:
        """Count the n-grams of `text` whose next token is at index >= start."""
        lo, hi, table = self.cfg.min_ngram, self.cfg.max_ngram, self.table
        for i in range(max(start, 1), len(text)):
            nxt = text[i]
            for n in range(lo, min(hi, i) + 1):
                ctx = tuple(text[i - n : i])
                row = table.get(ctx)
                if row is None:
                    table[ctx] = {nxt: 1}
                else:
                    row[nxt] = row.get(nxt, 0) + 1

    def extend(self, member: Hashable, tokens: Sequence[int], offset: int = 0) -> int:
        """Count the n-grams of the member's output tokens[offset:] that end at tokens not seen yet (the
        output is not copied: a sequence passes its whole token list and its prompt length); returns how
        many tokens were new."""
        n_out = len(tokens) - offset
        done = self.seen.get(member, 0)
        if n_out <= done:
            return 0
        h = len(self.head)
        # the new tokens and the max_ngram tokens before them (from the head where the output is short)
        lo = max(done - self.cfg.max_ngram, 0)
        ctx = (self.head[max(h - (self.cfg.max_ngram - done), 0):] if done < self.cfg.max_ngram else []) + list(
            tokens[offset + lo:])
        self.add_text(ctx, len(ctx) - (n_out - done))
        self.seen[member] = n_out
        return n_out - done

    def propose(self, context: list[int], k: int) -> list[int]:
        cfg, table = self.cfg, self.table
        ctx = list(context[-cfg.max_ngram:])
        out: list[int] = []
        while len(out) < k:
            row = None
            for n in range(min(cfg.max_ngram, len(ctx)), cfg.min_ngram - 1, -1):
                row = table.get(tuple(ctx[len(ctx) - n:]))
                if row is not None:
                    break
            if row is None:
                break
            if len(row) == 1:  # most contexts of a few tokens or more were followed by one token
                (tok, cnt), = row.items()
            else:
                tok, cnt = max(row.items(), key=_by_count)
            if cfg.min_share > 0 and cnt < cfg.min_share * sum(row.values()):
                break
            out.append(tok)
            ctx.append(tok)
            if len(ctx) > cfg.max_ngram:
                del ctx[0]
        return out


class SuffixDrafter:
    """Drafts per group (a request): `open`, `extend` with members' outputs, `propose`, `close`; and
    `remember` a prompt's finished responses for its later groups."""

    def __init__(self, cfg: DrafterConfig | None = None):
        self.cfg = cfg or DrafterConfig()
        self.groups: dict[Hashable, _Group] = {}
        self.cache: OrderedDict[Hashable, list[list[int]]] = OrderedDict()

    def open(self, group: Hashable, prompt: Sequence[int], prompt_key: Hashable | None = None) -> None:
        """Start a group for a prompt, seeded with the prompt's earlier responses when the prompt cache
        holds them (prompt_key: what identifies the prompt, images included; None: its token ids)."""
        if group in self.groups:
            raise ValueError(f"group {group!r} is already open")
        g = _Group(self.cfg, list(prompt[-self.cfg.max_ngram:]))
        self.groups[group] = g
        key = tuple(prompt) if prompt_key is None else prompt_key
        if key in self.cache:
            self.cache.move_to_end(key)
            for j, resp in enumerate(self.cache[key]):
                g.extend(("cached", j), resp)

    def extend(self, group: Hashable, member: Hashable, output: Sequence[int], offset: int = 0) -> int:
        """Index a member's output so far, output[offset:] (only the tokens added since its last call are
        counted); returns how many tokens were new."""
        return self.groups[group].extend(member, output, offset)

    def propose(self, group: Hashable, output: Sequence[int], k: int, offset: int = 0) -> list[int]:
        """Up to k draft tokens to follow output[offset:] (a member's output so far) in `group`."""
        if k < 1:
            return []
        g = self.groups[group]
        context = list(output[max(offset, len(output) - self.cfg.max_ngram):])
        if len(context) < self.cfg.max_ngram:
            context = g.head[max(len(g.head) - (self.cfg.max_ngram - len(context)), 0):] + context
        return g.propose(context, k)

    def close(self, group: Hashable) -> None:
        """Drop a group (no error if it was never opened)."""
        self.groups.pop(group, None)

    def remember(self, prompt: Sequence[int], responses: Iterable[Sequence[int]],
                 prompt_key: Hashable | None = None) -> None:
        """Keep a prompt's finished responses for later groups of it (a no-op with the cache off)."""
        if not self.cfg.cache_prompts:
            return
        key = tuple(prompt) if prompt_key is None else prompt_key
        kept = self.cache.pop(key, [])
        kept = (kept + [list(r) for r in responses if r])[-self.cfg.cache_responses:]
        self.cache[key] = kept
        while len(self.cache) > self.cfg.cache_prompts:
            self.cache.popitem(last=False)

    def retain(self, groups: Iterable[Hashable]) -> None:
        """Close every open group not in `groups`."""
        keep = set(groups)
        for g in [g for g in self.groups if g not in keep]:
            self.close(g)
