"""Qwen3-VL (dense) for Rollplex: the Qwen2.5-VL model's paths with the Qwen3-VL tower and decoder.

Everything that runs the model - the prefix / response split, the packed group forward, the engine's
prefill and decode, a frozen tower's reused features - is `Qwen25VL`'s (qwen2_5_vl.py); the family
differs only in the parts those paths call:

* the vision tower (vision3.py): learned interpolated positions, full attention, DeepStack mergers;
  its rows carry [merged | DeepStack 0 | 1 | ...] features, `deepstack_layers` = K of them;
* the decoder (text.py with `TextConfig.qk_norm`): q/k head RMSNorm, no q/k/v bias;
* interleaved M-RoPE (rope.py, `TextConfig.mrope_interleaved`);
* DeepStack: `embed_prompts` splits the tower's rows into the placeholder embeddings and the
  features added after the first K layers at the same rows (`text.DeepStack`). They are part of the
  prompt: a PrefixState's K/V hold them, responses never take any.

Image positions are Qwen2.5-VL's (text after an image resumes at max + 1). A video is a run of frame
blocks, `<t seconds><|vision_start|><|video_pad|>...<|vision_end|>` per temporal patch: the timestamps
are text, and each frame takes positions like a one-frame image (`prompt_positions`); the tower encodes
the video whole (attention within each frame).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from .config3 import Qwen3VLConfig
from .inputs import ModelInputs
from .ops import ForwardOps
from .qwen2_5_vl import Qwen25VL
from .rope import mrope_positions
from .vision3 import Qwen3VisionTower, tensor_parallel_post


class Qwen3VL(Qwen25VL):
    family = "qwen3_vl"

    def __init__(self, cfg: Qwen3VLConfig):
        if not isinstance(cfg, Qwen3VLConfig):
            raise ValueError(f"Qwen3VL needs a Qwen3VLConfig, got {type(cfg).__name__}")
        super().__init__(cfg)

    @property
    def deepstack_layers(self) -> int:  # type: ignore[override]
        return self.cfg.deepstack_layers

    @staticmethod
    def vision_tower(cfg: Qwen3VLConfig) -> nn.Module:
        return Qwen3VisionTower(cfg.vision)

    def _visual_features(self, prompts: Sequence[ModelInputs], ops: ForwardOps | None = None) -> list:
        if ops is not None and ops.vision_post is not None:  # the tower's blocks are a rank's shards
            if ops.reduce is None:
                raise ValueError("a tensor-parallel Qwen3-VL tower needs ForwardOps.reduce (its blocks are not "
                                 "Qwen2.5-VL's, whose vision_post it cannot run)")
            ops = replace(ops, vision_post=tensor_parallel_post(ops.reduce))
        return super()._visual_features(prompts, ops)

    def prompt_positions(self, ids: list[int], p: ModelInputs) -> tuple[torch.Tensor, int]:
        """Qwen3-VL's videos are frame blocks with their timestamps as text between them: each frame
        (temporal patch) is a (1, h, w) block of its own, placed like an image."""
        frames = [(1, h, w) for t, h, w in p.video_grids for _ in range(t)]
        return mrope_positions(ids, self.cfg, p.image_grids, frames)
