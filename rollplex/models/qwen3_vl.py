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

Image positions are Qwen2.5-VL's (text after an image resumes at max + 1). Videos are not supported
yet: Qwen3-VL puts timestamps as text between frames, which needs its own processor path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from .config3 import Qwen3VLConfig
from .inputs import ModelInputs
from .ops import ForwardOps
from .qwen2_5_vl import EmbeddedPrompts, Qwen25VL
from .vision3 import Qwen3VisionTower


class Qwen3VL(Qwen25VL):
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

    def embed_prompts(self, prompts: Sequence[ModelInputs], ops: ForwardOps | None = None) -> EmbeddedPrompts:
        if any(p.video_grids for p in prompts):
            raise ValueError("Qwen3-VL video inputs are not supported yet (images and text are)")
        return super().embed_prompts(prompts, ops)
