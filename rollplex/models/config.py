"""Typed model configuration read from (and written back to) HF `Qwen2_5_VLConfig` / `Qwen3VLConfig`.

transformers parses config.json for us (flat legacy layouts, nested `text_config`, `rope_scaling`
vs `rope_parameters`); we copy the handful of fields the model needs into frozen dataclasses so the
rest of Rollplex never touches a `PretrainedConfig`. `to_hf()` goes the other way, so checkpoints we
write load in `Qwen2_5_VLForConditionalGeneration.from_pretrained`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError("vision window_size must be a multiple of patch_size * spatial_merge_size")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ValueError(f"fullatt_block_indexes {self.fullatt_block_indexes} out of range for depth {self.depth}")
        if self.hidden_act != "silu":
            raise ValueError(f"vision hidden_act {self.hidden_act!r} unsupported (Qwen2.5-VL uses silu)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = True
    hidden_act: str = "silu"
    # the Qwen3 decoder: no q/k/v bias, RMSNorm over each q/k head, a head dim of its own, M-RoPE
    # frequencies interleaved over t/h/w (t h w t h w ... t t) instead of one section per axis
    attention_bias: bool = True
    qk_norm: bool = False
    explicit_head_dim: int | None = None
    mrope_interleaved: bool = False

    def __post_init__(self):
        if self.explicit_head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.explicit_head_dim is not None and (self.explicit_head_dim <= 0 or self.explicit_head_dim % 2):
            raise ValueError(f"head_dim {self.explicit_head_dim} must be a positive even number")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} unsupported (Qwen2.5-VL uses silu)")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    pad_token_id: int | None = None

    family = "qwen2_5_vl"  # the model type of config.json; models.family builds the model class for it
    # family -> config class: each family's config class enters here when it is defined (config3.py),
    # so `ModelConfig.from_hf` reads any family without this module importing theirs
    _families: ClassVar[dict[str, type[ModelConfig]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "family" in cls.__dict__:
            ModelConfig._families[cls.family] = cls

    def __post_init__(self):
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError("vision out_hidden_size must equal text hidden_size")
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if not 0 <= getattr(self, name) < self.text.vocab_size:
                raise ValueError(f"{name}={getattr(self, name)} outside vocab of size {self.text.vocab_size}")

    # ---- HF interop -------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """From a `Qwen2_5_VLConfig`, a config dict (flat or nested) or a checkpoint directory. On
        `ModelConfig` itself this reads the family from `model_type`: a Qwen3-VL config gives a
        `Qwen3VLConfig` (config3.py), so callers load either family through this one entry point."""
        from transformers import Qwen2_5_VLConfig

        kind = model_type(hf)
        if kind is not None and kind != ModelConfig.family and kind not in ModelConfig._families:
            raise ValueError(f"model type {kind!r} is not supported (Qwen2.5-VL and dense Qwen3-VL are; "
                             "docs/MODELS.md)")
        if cls is ModelConfig and kind in ModelConfig._families:
            return ModelConfig._families[kind].from_hf(hf)
        if isinstance(hf, str) or hasattr(hf, "__fspath__"):
            hf = Qwen2_5_VLConfig.from_pretrained(str(hf))
        elif isinstance(hf, dict):
            hf = Qwen2_5_VLConfig.from_dict(dict(hf))
        t, v = hf.text_config, hf.vision_config
        rope = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        text = TextConfig(
            **hf_attrs(t, TEXT_ATTRS),
            rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 1e6))),
            mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))),
            tie_word_embeddings=bool(hf.tie_word_embeddings),
        )
        vrope = dict(getattr(v, "rope_parameters", None) or {})
        vision = VisionConfig(
            **hf_attrs(v, VISION_ATTRS + " window_size out_hidden_size tokens_per_second"),
            fullatt_block_indexes=tuple(v.fullatt_block_indexes),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
        )
        return cls(text=text, vision=vision, **hf_token_ids(hf))

    def to_hf_dict(self) -> dict:
        """A config.json dict in the layout of the released Qwen2.5-VL checkpoints (flat text fields)."""
        t, v = self.text, self.vision
        vision = asdict(v)
        vision.pop("rope_theta")
        vision["fullatt_block_indexes"] = list(v.fullatt_block_indexes)
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads,
            "hidden_act": t.hidden_act,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta,
            "rope_scaling": {"type": "mrope", "mrope_section": list(t.mrope_section)},
            "max_position_embeddings": t.max_position_embeddings,
            "max_window_layers": t.num_hidden_layers,
            "sliding_window": None,
            "use_sliding_window": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": t.tie_word_embeddings,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "vision_token_id": self.image_token_id - 1,
            "torch_dtype": "bfloat16",
            "vision_config": vision,
        }


# the fields our configs take from an HF config's text / vision config by the same name
TEXT_ATTRS = ("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
              "rms_norm_eps max_position_embeddings hidden_act")
VISION_ATTRS = "depth hidden_size intermediate_size num_heads in_channels patch_size temporal_patch_size " \
               "spatial_merge_size hidden_act"


def hf_attrs(src: Any, names: str) -> dict[str, Any]:
    """{name: src.name} for the space-separated `names`: fields an HF config and ours share."""
    return {n: getattr(src, n) for n in names.split()}


def hf_token_ids(hf: Any) -> dict[str, int | None]:
    """The special token ids of an HF vision-language config (eos: the text config's, else the top level's;
    the first of a list)."""
    t = hf.text_config
    eos = getattr(t, "eos_token_id", None)
    if eos is None:
        eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return dict(image_token_id=hf.image_token_id, video_token_id=hf.video_token_id,
                vision_start_token_id=hf.vision_start_token_id, vision_end_token_id=hf.vision_end_token_id,
                bos_token_id=getattr(t, "bos_token_id", None), eos_token_id=eos,
                pad_token_id=getattr(t, "pad_token_id", None))


def model_type(hf: Any) -> str | None:
    """`model_type` of an HF config object, a config dict or a checkpoint directory's config.json."""
    import json
    from pathlib import Path

    if isinstance(hf, str) or hasattr(hf, "__fspath__"):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise ValueError(f"{hf}: no config.json")
        hf = json.loads(path.read_text())
    if isinstance(hf, dict):
        return hf.get("model_type")
    return getattr(hf, "model_type", None)
