"""Qwen2.5-VL and Qwen3-VL in plain PyTorch: one definition per family for the engine, the reference
scorer and the trainer."""

from .config import ModelConfig, TextConfig, VisionConfig
from .config3 import Qwen3VisionConfig, Qwen3VLConfig
from .family import build_model, hf_model, model_class
from .hf_io import hf_to_rollplex, init_weights, load_model, rollplex_to_hf, save_model
from .inputs import ModelInputs
from .ops import ForwardOps
from .qwen2_5_vl import EmbeddedPrompts, PrefixState, Qwen25VL
from .qwen3_vl import Qwen3VL

__all__ = [
    "EmbeddedPrompts", "ForwardOps", "ModelConfig", "ModelInputs", "PrefixState", "Qwen25VL", "Qwen3VL",
    "Qwen3VLConfig", "Qwen3VisionConfig", "TextConfig", "VisionConfig",
    "build_model", "hf_model", "hf_to_rollplex", "init_weights", "load_model", "model_class", "rollplex_to_hf",
    "save_model",
]
