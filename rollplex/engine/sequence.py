"""Requests and sequences: plain Python objects the scheduler moves between queues (no torch).

A `Request` is one prompt with its sampling parameters and `n` samples; each sample is a `Sequence`.
The n sequences of a fresh request are prefilled once, as a group: the leader runs the prompt
(vision tower + prefill) and the others fork its KV blocks. A preempted sequence loses its KV and
returns to the waiting queue alone; its next prefill recomputes prompt + generated tokens.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams

_seq_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: Request
    sample_index: int
    token_ids: list[int]
    seed: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    num_preemptions: int = 0
    # tokens sampled by a decode step still in flight (overlap scheduling): counted in len() — the
    # scheduler and block manager plan with them — but not yet in token_ids / logprobs
    pending: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        """Resolved output tokens (pending ones excluded)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens including pending ones: the index of the next token to draw."""
        return len(self.token_ids) + self.pending - self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    request_id: str
    inputs: Any  # models.ModelInputs (opaque to the scheduler, which reads input_ids only and imports no torch)
    params: SamplingParams
    seeds: list[int]
    arrival: float = 0.0
    rope_delta: int = 0  # M-RoPE: output token j sits at position len(prompt) + j + rope_delta
    seqs: list[Sequence] = field(default_factory=list)
    input_logprobs: list[float] | None = None
    aborted: bool = False
    max_len: int = 1 << 62  # tokens (prompt + output) at which a sample stops by length; set by the engine
    keep_vision: bool = False  # keep the prefill's visual features (`vision_embeds`) for the caller
    vision_embeds: Any = None  # [placeholders, C] device tensor, set at prefill when keep_vision

    def __post_init__(self):
        prompt = list(self.inputs.input_ids)
        self.num_prompt_tokens = len(prompt)
        # the n samples, then the greedy continuations (sample_index >= n: temperature 0)
        self.seqs = [Sequence(self, i, list(prompt), self.seeds[i]) for i in range(self.params.num_seqs)]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
