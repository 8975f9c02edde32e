"""Qwen2.5-VL in plain PyTorch: one definition for the engine, the reference scorer and the trainer."""

from .checkpoint import hf_to_rollplex, init_weights, load_model, rollplex_to_hf, save_model
from .config import ModelConfig, TextConfig, VisionConfig
from .inputs import ModelInputs
from .ops import ForwardOps
from .qwen2_5_vl import EmbeddedPrompts, PrefixState, Qwen25VL

__all__ = [
    "EmbeddedPrompts", "ForwardOps", "ModelConfig", "ModelInputs", "PrefixState", "Qwen25VL", "TextConfig",
    "VisionConfig",
    "hf_to_rollplex", "init_weights", "load_model", "rollplex_to_hf", "save_model",
]
