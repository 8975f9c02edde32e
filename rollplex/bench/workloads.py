"""The step bench's workloads: prompts, samples per prompt and each sample's response length.

    w3b              --prompts x n, one image, every sample --new-tokens long
    w3b-tail         the same, lengths from a long tail: log-normal, median new_tokens / 4, at most
                     new_tokens, drawn per sample (a prompt's factor times a sample's own, as EOS
                     ends real responses of one group at different tokens)
    w3b-video(-tail) --video-prompts, one video of 8 frames
    w3b-long-tail    reasoning-length rollouts: --long-prompts x --long-n (16 x 16), log-normal
                     lengths with median --long-median (800) up to --long-new-tokens (4096); trained
                     with activation checkpointing and micro-batches cut by a token budget

The shapes are the preset's (`--preset qwen3-vl-4b` runs the same workloads on Qwen3-VL-4B). Lengths
are seeded, the same in every step of a run, and the longest sample of a batch is set to the longest
allowed, so the rollout decodes to it; each reaches the engine as `SamplingParams.sample_max_new_tokens`
with ignore_eos (the random weights never sample EOS on purpose). Torch is used only to draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine import SamplingParams

WORKLOADS = ("w3b", "w3b-tail", "w3b-video", "w3b-video-tail", "w3b-long-tail")


@dataclass(frozen=True)
class Workload:
    label: str
    prompts: int
    n: int
    frames: int  # 1: one image per prompt; > 1: one video of that many frames
    new_tokens: int  # the longest response
    lengths: tuple[tuple[int, ...], ...] | None  # per prompt, per sample; None: every sample new_tokens
    long: bool = False  # reasoning-length: checkpointing and token-budgeted micro-batches by default

    def params(self, seed: int) -> list[SamplingParams]:
        """One SamplingParams per prompt: its n samples, their lengths, seeds distinct per step."""
        out = []
        for i in range(self.prompts):
            caps = self.lengths[i] if self.lengths is not None else None
            out.append(SamplingParams(n=self.n, max_new_tokens=max(caps) if caps else self.new_tokens,
                                      sample_max_new_tokens=caps, ignore_eos=True, seed=seed * 100_003 + i))
        return out

    def response_tokens(self) -> int:
        return sum(map(sum, self.lengths)) if self.lengths is not None else self.prompts * self.n * self.new_tokens


def sample_lengths(prompts: int, n: int, longest: int, median: float, seed: int, sigma_prompt: float = 0.6,
                   sigma_sample: float = 0.6, shortest: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Per prompt, n response lengths: median x exp(sigma_prompt z_prompt + sigma_sample z_sample), within
    [shortest, longest] (default shortest: 16, less for tiny test lengths); the batch's longest sample is set
    to `longest`."""
    shortest = max(1, min(16, longest // 8)) if shortest is None else shortest
    if prompts < 1 or n < 1 or not 1 <= shortest <= longest:
        raise ValueError("sample_lengths needs prompts, n >= 1 and 1 <= shortest <= longest")
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(prompts, 1, generator=g) * sigma_prompt + torch.randn(prompts, n, generator=g) * sigma_sample
    x = (torch.exp(z) * median).clamp(shortest, longest).round().long()
    x.view(-1)[int(x.argmax())] = longest
    return tuple(tuple(row) for row in x.tolist())


def workload(label: str, args, n: int) -> Workload:
    """The workload `label` from the bench's flags (`args`: prompts, video_prompts, new_tokens, long_*) and
    the configured samples per prompt `n` (the long-tail workload has its own)."""
    if label not in WORKLOADS:
        raise ValueError(f"unknown workload {label!r}: one of {WORKLOADS}")
    if label == "w3b-long-tail":
        lens = sample_lengths(args.long_prompts, args.long_n, args.long_new_tokens,
                              min(args.long_median, args.long_new_tokens), seed=11, sigma_prompt=0.5, sigma_sample=0.5)
        return Workload(label, args.long_prompts, args.long_n, 1, args.long_new_tokens, lens, long=True)
    frames = 8 if label.startswith("w3b-video") else 1
    prompts = args.video_prompts if frames > 1 else args.prompts
    lens = sample_lengths(prompts, n, args.new_tokens, args.new_tokens / 4, seed=7) if label.endswith("-tail") else None
    return Workload(label, prompts, n, frames, args.new_tokens, lens)
