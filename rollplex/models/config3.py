"""Typed configuration of Qwen3-VL (dense), read from and written back to HF `Qwen3VLConfig`.

The text side is the shared `TextConfig` with the Qwen3 switches on (no q/k/v bias, q/k RMSNorm, an
explicit head dim, interleaved M-RoPE). The vision side is its own: patch 16, learned position
embeddings (`num_position_embeddings`, a square table interpolated to each grid), full attention in
every block (no windows), a GELU MLP, and DeepStack: the features after the blocks in
`deepstack_visual_indexes` go through mergers of their own and are added to the hidden states of the
first text layers at the visual token positions.

`to_hf_dict()` writes the nested layout of the released checkpoints (`text_config`, `vision_config`,
`rope_scaling` with `mrope_interleaved`), which transformers' `Qwen3VLForConditionalGeneration` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import TEXT_ATTRS, VISION_ATTRS, ModelConfig, TextConfig, hf_attrs, hf_token_ids

_VISION_ACTS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class Qwen3VisionConfig:
    depth: int = 24
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2560
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (5, 11, 17)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    tokens_per_second: int = 2  # kept for the shared position code; Qwen3-VL videos put time in text

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must give a "
                             "head dim divisible by 4 (2D rotary)")
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        if any(not 0 <= i < self.depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"deepstack_visual_indexes {self.deepstack_visual_indexes} out of range for depth "
                             f"{self.depth}")
        if self.hidden_act not in _VISION_ACTS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} unsupported (one of {_VISION_ACTS})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position-embedding table."""
        return round(self.num_position_embeddings**0.5)


def qwen3_text(**kw) -> TextConfig:
    """A `TextConfig` with the Qwen3 decoder's switches on."""
    base = dict(attention_bias=False, qk_norm=True, mrope_interleaved=True, rope_theta=5000000.0,
                mrope_section=(24, 20, 20), explicit_head_dim=128, max_position_embeddings=262144)
    return TextConfig(**{**base, **kw})


@dataclass(frozen=True)
class Qwen3VLConfig(ModelConfig):
    text: TextConfig = field(default_factory=lambda: qwen3_text(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True))
    vision: Qwen3VisionConfig = field(default_factory=Qwen3VisionConfig)

    family = "qwen3_vl"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.vision, Qwen3VisionConfig):
            raise ValueError("a Qwen3-VL config needs a Qwen3VisionConfig")
        t = self.text
        if t.attention_bias or not t.qk_norm:
            raise ValueError("the Qwen3-VL decoder has q/k RMSNorm and no attention bias")

    @property
    def deepstack_layers(self) -> int:
        """How many first text layers take DeepStack features (one per `deepstack_visual_indexes`)."""
        return len(self.vision.deepstack_visual_indexes)

    @classmethod
    def from_hf(cls, hf: Any) -> Qwen3VLConfig:
        """From a `Qwen3VLConfig`, a config dict or a checkpoint directory."""
        from transformers import Qwen3VLConfig as HFConfig

        if isinstance(hf, str) or hasattr(hf, "__fspath__"):
            hf = HFConfig.from_pretrained(str(hf))
        elif isinstance(hf, dict):
            hf = HFConfig.from_dict(dict(hf))
        t, v = hf.text_config, hf.vision_config
        rope = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
            raise ValueError(f"rope type {rope.get('rope_type')!r} unsupported (Qwen3-VL uses default M-RoPE)")
        if getattr(t, "attention_bias", False):
            raise ValueError("attention_bias=True is not a Qwen3-VL decoder")
        text = qwen3_text(
            **hf_attrs(t, TEXT_ATTRS),
            explicit_head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
            rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 5e6))),
            mrope_section=tuple(rope.get("mrope_section", (24, 20, 20))),
            mrope_interleaved=bool(rope.get("mrope_interleaved", True)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )
        vrope = dict(getattr(v, "rope_parameters", None) or {})
        vision = Qwen3VisionConfig(
            **hf_attrs(v, VISION_ATTRS + " out_hidden_size num_position_embeddings"),
            deepstack_visual_indexes=tuple(v.deepstack_visual_indexes),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
        )
        return cls(text=text, vision=vision, **hf_token_ids(hf))

    def to_hf_dict(self) -> dict:
        """A config.json dict in the nested layout of the released Qwen3-VL checkpoints."""
        t, v = self.text, self.vision
        return {
            "architectures": ["Qwen3VLForConditionalGeneration"],
            "model_type": "qwen3_vl",
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "torch_dtype": "bfloat16",
            "text_config": {
                "model_type": "qwen3_vl_text",
                "vocab_size": t.vocab_size,
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "head_dim": t.head_dim,
                "hidden_act": t.hidden_act,
                "rms_norm_eps": t.rms_norm_eps,
                "rope_theta": t.rope_theta,
                "rope_scaling": {"rope_type": "default", "mrope_section": list(t.mrope_section),
                                 "mrope_interleaved": t.mrope_interleaved},
                "max_position_embeddings": t.max_position_embeddings,
                "attention_bias": False,
                "attention_dropout": 0.0,
                "tie_word_embeddings": t.tie_word_embeddings,
                "use_cache": True,
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id,
            },
            "vision_config": {
                "model_type": "qwen3_vl_vision",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_channels": v.in_channels,
                "patch_size": v.patch_size,
                "temporal_patch_size": v.temporal_patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "out_hidden_size": v.out_hidden_size,
                "num_position_embeddings": v.num_position_embeddings,
                "deepstack_visual_indexes": list(v.deepstack_visual_indexes),
                "hidden_act": v.hidden_act,
            },
        }
