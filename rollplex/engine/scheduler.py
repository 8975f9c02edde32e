"""Continuous-batching scheduler (no torch): who prefills, who decodes, who gets preempted.

Each call to `schedule()` returns one batch: a prefill batch if any waiting work fits (prefill first
keeps the decode batch full), else a decode batch of every running sequence.

* Admission is by KV capacity: a fresh request needs the blocks of its prompt plus one block per
  extra sample when the prompt ends inside a block (the n samples share the prompt's full blocks).
* A prefill batch is bounded by `max_num_seqs` running sequences and `max_num_batched_tokens`.
* Decode needs one slot per sequence; when blocks run out the newest running sequence is preempted
  (recompute: its blocks are freed and it waits, first in line, to be prefilled again with its
  prompt + generated tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Request, SeqStatus, Sequence


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("scheduler limits must be positive (max_model_len >= 2)")


@dataclass
class PrefillItem:
    seq: Sequence  # whose tokens are computed (a fresh request's leader, or a preempted sequence)
    forks: list[Sequence] = field(default_factory=list)  # siblings that share the leader's prompt KV
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies after prefill

    @property
    def num_tokens(self) -> int:
        return len(self.seq)


@dataclass
class Batch:
    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Request | Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """ValueError for a request that could never run (too long, or larger than the whole cache)."""
        L, n = request.num_prompt_tokens, len(request.seqs)  # samples and greedy continuations
        if L >= self.cfg.max_model_len:
            raise ValueError(f"prompt of {L} tokens does not fit max_model_len={self.cfg.max_model_len}")
        if n > self.cfg.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs={self.cfg.max_num_seqs}")
        need = self._fresh_cost(request) + n  # + one decode block each, worst case
        if need > self.blocks.num_blocks - 1:
            raise ValueError(f"request needs {need} KV blocks, the cache has {self.blocks.num_blocks - 1}")

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        request.aborted = True
        self.waiting = deque(w for w in self.waiting if (w if isinstance(w, Request) else w.request) is not request)
        for s in request.seqs:
            if not s.finished:
                self.finish(s, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:  # a preempted sequence
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.blocks.free(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------------
    def _fresh_cost(self, r: Request) -> int:
        L = r.num_prompt_tokens
        return self.blocks.blocks_for(L) + (len(r.seqs) - 1) * self.blocks.fork_cost(L)

    def schedule(self, hold: frozenset = frozenset()) -> Batch:
        """hold: running sequences to leave out of a decode batch (their last token is still in flight)."""
        batch = self._schedule_prefill()
        if batch.prefill:
            return batch
        return self._schedule_decode(hold)

    def _schedule_prefill(self) -> Batch:
        batch, tokens = Batch(), 0
        while self.waiting:
            head = self.waiting[0]
            if isinstance(head, Request):
                seqs, n_tok, cost = head.seqs, head.num_prompt_tokens, self._fresh_cost(head)
            else:
                seqs, n_tok, cost = [head], len(head), self.blocks.blocks_for(len(head))
            if len(self.running) + len(seqs) > self.cfg.max_num_seqs:
                break
            if batch.prefill and tokens + n_tok > self.cfg.max_num_batched_tokens:
                break
            if cost > self.blocks.num_free:
                break
            self.waiting.popleft()
            leader = seqs[0]
            self.blocks.allocate(leader, len(leader))
            item = PrefillItem(leader)
            for s in seqs[1:]:
                copy = self.blocks.fork(leader, s, len(leader))
                item.forks.append(s)
                if copy:
                    item.copies.append(copy)
            for s in seqs:
                s.status = SeqStatus.RUNNING
                self.running.append(s)
            batch.prefill.append(item)
            tokens += n_tok
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _schedule_decode(self, hold: frozenset = frozenset()) -> Batch:
        batch = Batch()
        queue = deque(s for s in self.running if s not in hold)
        while queue:
            seq = queue.popleft()
            while self.blocks.needs_block(seq) and self.blocks.num_free == 0:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.append_slot(seq)
                batch.decode.append(seq)
        return batch
