"""What a demo run says before and during its steps: the CPU cost warning, the in-step progress, and
whether stdout gets a step bar or lines (`log_mode`: lines in a log file or a terminal too narrow for a bar).

`step_cost` estimates one GRPO step's work from the model's decoder parameters and the step's tokens
(2 FLOP per parameter per token for the rollout and for reference scoring, 6 for the update's forward
and backward), and `cpu_cost_warning` turns it into seconds at this CPU's measured matmul rate. The
estimate leaves out the vision tower, attention and all host overhead, and real layers run below a
plain matmul's rate, so it is a floor: the warning says "at least". The embedded tiny model's step is
~1e11 FLOP, well under a second; a 3B model's is minutes to hours.

`StepProgress` reports inside a step, from hooks on the real objects (nothing in the step is changed):
the rollout's sampled tokens and finished samples from the engine's decode-loop hook (the prefilled
requests' sequences, read when a line is due), and the update's micro-batches from a gradient hook on
the policy's last trained parameter (it fires once per backward pass). Lines are throttled to one per
`every_s` seconds (the first `every_s` into a step) and go to a sink: the step bar's postfix on a
terminal, a printed line otherwise.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

WARN_STEP_S = 60.0  # a CPU step estimated at least this long gets the warning
MIN_BAR_COLUMNS = 40  # a terminal narrower than this gets lines, as a log does


def log_mode(stream) -> bool:
    """True when `stream` is no terminal, or one too narrow to draw a step bar in (a pseudo-terminal of width 0)."""
    if not stream.isatty():
        return True
    try:
        return os.get_terminal_size(stream.fileno()).columns < MIN_BAR_COLUMNS
    except (OSError, ValueError, AttributeError):
        return True


def decoder_params(model) -> int:
    """Parameters outside the vision tower: what each text token runs through."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith("visual."))


def step_cost(params: int, prompt_tokens: int, prompts: int, n: int, max_new_tokens: int, mode: str = "rollplex",
              ref: bool = False) -> tuple[int, float]:
    """(tokens scored per step, FLOP per step) for `prompts` prompts of `prompt_tokens` tokens, `n`
    samples of up to `max_new_tokens` each. The rollout prefills each prompt once (its samples share
    the KV); scoring and the update compute each prompt once in rollplex mode, per sample in serial."""
    rollout = prompts * (prompt_tokens + n * max_new_tokens)
    scored = rollout if mode == "rollplex" else prompts * n * (prompt_tokens + max_new_tokens)
    flops = 2.0 * params * rollout + (6.0 + (2.0 if ref else 0.0)) * params * scored
    return scored, flops


def matmul_rate(seconds: float = 0.1, size: int = 512) -> float:
    """FLOP/s of fp32 `size`² matmuls on this CPU with torch's threads, timed for about `seconds`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: thread pool, allocation
    n, t0 = 0, time.perf_counter()
    while (dt := time.perf_counter() - t0) < seconds:
        a @ b
        n += 1
    return 2.0 * size**3 * n / dt


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} h" if s >= 5400 else f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def cpu_cost_warning(params: int, prompt_tokens: int, prompts: int, n: int, max_new_tokens: int,
                     mode: str = "rollplex", ref: bool = False, rate: float | None = None) -> str | None:
    """A warning when one CPU step is estimated at >= WARN_STEP_S seconds, else None. `rate`: FLOP/s
    (default: `matmul_rate()`, measured only when the step could reach the bound at 10 TFLOP/s)."""
    tokens, flops = step_cost(params, prompt_tokens, prompts, n, max_new_tokens, mode, ref)
    if rate is None:
        if flops / 1e13 < WARN_STEP_S:  # faster than any CPU runs it: skip the measurement
            return None
        rate = matmul_rate()
    seconds = flops / rate
    if seconds < WARN_STEP_S:
        return None
    return (f"warning: CPU run: one step is about {flops:.2g} FLOP ({params / 1e9:.3g}B decoder parameters x "
            f"{tokens:,} tokens: {prompts} prompts of {prompt_tokens} tokens, {n} samples of up to {max_new_tokens} "
            f"new tokens), at least {_duration(seconds)} per step at this CPU's matmul rate "
            f"({rate / 1e9:.0f} GFLOP/s). A GPU, the tiny model, or fewer prompts, samples or new tokens shorten it.")


class StepProgress:
    """In-step progress of an RLStep on the native engine (see the module docstring). `begin(step)`
    before each step; `close()` removes the hooks."""

    def __init__(self, model, engine, prompts: int, n: int, passes: int | None, sink: Callable[[str], None],
                 every_s: float = 5.0):
        self.sink, self.every_s = sink, every_s
        self.total_samples, self.passes_total = prompts * n, passes
        self.engine = engine
        engine.hooks.append(self)
        trained = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("visual.")]
        self._grad_hook = trained[-1].register_post_accumulate_grad_hook(self._on_backward)
        self.step = 0
        self.active = False
        self._last = -math.inf
        self._requests: dict[int, object] = {}
        self.passes = 0

    def begin(self, step: int) -> None:
        """A step starts: the first line comes `every_s` after this (a short step shows none)."""
        self.step, self.active, self.passes = step, True, 0
        self._requests = {}
        self._last = time.monotonic()

    def end(self) -> None:
        self.active = False
        self._requests = {}

    # engine decode-loop hook (engine/hooks.py)
    def on_prefill(self, requests) -> None:
        if self.active:
            for r in requests:
                self._requests.setdefault(id(r), r)
            self._maybe_emit()

    def on_decode_step(self, info) -> None:
        if self.active:
            self._maybe_emit()

    def _on_backward(self, _param) -> None:
        if self.active:
            self.passes += 1
            self._maybe_emit()

    def rollout_counts(self) -> tuple[int, int, int]:
        """(sampled tokens, finished samples, prompts prefilled) of this step's rollout so far."""
        seqs = [s for r in self._requests.values() for s in r.seqs]
        return sum(s.num_output_tokens for s in seqs), sum(s.finished for s in seqs), len(self._requests)

    def line(self) -> str:
        if self.passes:
            total = f"/{self.passes_total}" if self.passes_total and self.passes <= self.passes_total else ""
            return f"step {self.step} update: {self.passes}{total} micro-batches"
        tokens, done, _ = self.rollout_counts()
        return f"step {self.step} rollout: {tokens:,} tokens, {done}/{self.total_samples} samples done"

    def _maybe_emit(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self.sink(self.line())

    def close(self) -> None:
        self.active = False
        if self in self.engine.hooks:
            self.engine.hooks.remove(self)
        self._grad_hook.remove()


def expected_passes(cfg, prompts: int) -> int | None:
    """Backward passes of one update for `prompts` prompts under `cfg` (an RLConfig) with count-based
    micro-batches; None under a token budget (the count depends on the lengths sampled)."""
    if cfg.micro_batch_max_tokens is not None:
        return None
    per_mini = [len(range(i, prompts, cfg.ppo_mini_batches)) for i in range(min(cfg.ppo_mini_batches, prompts))]
    if cfg.mode == "rollplex":
        per = sum(math.ceil(k / cfg.micro_batch_prompts) for k in per_mini)
    else:
        per = sum(math.ceil(k * cfg.n / cfg.micro_batch_samples) for k in per_mini)
    return cfg.ppo_epochs * per
