"""Sampling parameters of one request (SGLang's names and defaults), validated on construction.

Which distribution the returned logprobs come from — the one the RL step must reproduce:

    logprob(token) = log_softmax(logits / temperature)[token]      (temperature > 0)
    logprob(token) = log_softmax(logits)[token]                    (temperature == 0, greedy)

i.e. the policy at the sampling temperature, *before* top-k / top-p / min-p truncation (those only
restrict which tokens may be drawn; renormalising over the kept set would make the logprob depend on
the truncation and no longer match what the trainer computes from the same logits).
Input-token logprobs (`logprob_start_len`) use the same formula.

Sample i of a request with `n` samples and `seed=s` is drawn exactly as a request with `n=1` and
`seed=s+i`; without a seed the engine draws one per sample from its own seeded generator.

`n_greedy` adds that many greedy continuations (temperature 0, ReMax's baseline) after the n sampled
ones: they fork the prompt's KV like the samples (one prefill for all), are not counted in `n`, draw
no seed, and come back in `RequestOutput.greedy`; their logprobs are log_softmax(logits).
`sample_max_new_tokens` (the SGLang backend sends it as each sample's max_new_tokens) gives each of the n
samples its own length cap, at most `max_new_tokens`: with `ignore_eos` a benchmark's samples end at set, reproducible
lengths that differ within a group, as EOS ends real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEED_MAX = 2**63 - 1  # seeds are int64 on the device


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprob_start_len: int = -1  # >= 0: also return input-token logprobs from this prompt position
    n_greedy: int = 0  # greedy continuations beside the n samples (RequestOutput.greedy)
    sample_max_new_tokens: tuple[int, ...] | None = None  # per sample: its own cap (see the docstring)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not 0 <= int(self.seed) <= SEED_MAX - (self.n - 1):
            # sample i draws with seed + i, an int64 on the device
            raise ValueError(f"seed must be an integer in [0, 2**63 - n] (sample i uses seed + i, an int64), "
                             f"got {self.seed} with n={self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not isinstance(self.n_greedy, int) or self.n_greedy < 0:
            raise ValueError(f"n_greedy must be an integer >= 0, got {self.n_greedy!r}")
        if self.sample_max_new_tokens is not None:
            caps = tuple(self.sample_max_new_tokens)
            if len(caps) != self.n or any(not isinstance(c, int) or not 1 <= c <= self.max_new_tokens for c in caps):
                raise ValueError(f"sample_max_new_tokens must give each of the n={self.n} samples an integer cap in "
                                 f"[1, max_new_tokens={self.max_new_tokens}], got {self.sample_max_new_tokens!r}")
            self.sample_max_new_tokens = caps
        if self.logprob_start_len < -1:
            raise ValueError("logprob_start_len must be -1 (off) or >= 0")

    @property
    def num_seqs(self) -> int:
        """Sequences the request decodes: the n samples and the greedy continuations."""
        return self.n + self.n_greedy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
