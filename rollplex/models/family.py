"""Model families: which model class a config builds.

A config's class says its family (`ModelConfig.family`, the `model_type` of config.json):
`ModelConfig` is Qwen2.5-VL, `Qwen3VLConfig` Qwen3-VL. The rest of the runtime builds, loads and
saves models through `build_model` / hf_io.py, which dispatch here, so nothing outside models/
names a family.
"""

from __future__ import annotations

from .config import ModelConfig
from .qwen2_5_vl import Qwen25VL
from .qwen3_vl import Qwen3VL

# family -> model class (the classes say their family; qwen2_5_vl.py keeps the same table for
# `Qwen25VL(cfg)`, filled as each family's class is defined)
_CLASSES = {c.family: c for c in (Qwen25VL, Qwen3VL)}


def model_class(cfg: ModelConfig) -> type:
    """The model class of `cfg`'s family."""
    if cfg.family not in _CLASSES:
        raise ValueError(f"unknown model family {cfg.family!r}; known: {sorted(_CLASSES)}")
    return _CLASSES[cfg.family]


def build_model(cfg: ModelConfig):
    """An (uninitialised) model of `cfg`'s family; on the current default device."""
    return model_class(cfg)(cfg)


# transformers' config and model classes of each family (the reference implementations)
_HF_CLASSES = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
               "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")}


def hf_model(cfg: ModelConfig, attn_implementation: str = "sdpa"):
    """transformers' model of `cfg` (its own random init, on the current default device): the twin the
    parity tests and benchmarks load our model from (`hf_to_rollplex(hf.state_dict(), cfg)`)."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[cfg.family])
    hf_cfg = config_cls.from_dict(cfg.to_hf_dict())
    hf_cfg._attn_implementation = attn_implementation
    return model_cls(hf_cfg)
