"""The embedded tiny checkpoints (`python -m rollplex.tiny OUT_DIR [--seed N] [--family F]` writes one).

An ordinary HF directory (config.json, model.safetensors, tokenizer files, chat template,
preprocessor_config.json) with random weights: every code path of the real model (Qwen2.5-VL: window +
full vision attention, M-RoPE, GQA, untied head; Qwen3-VL: interpolated vision positions, DeepStack,
q/k norm, a head dim of its own, interleaved M-RoPE) at a size that trains on two CPU cores. Anything
that takes `--model` accepts it; `ensure_tiny()` creates it on first use under ~/.cache/rollplex.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..models import (
    ModelConfig,
    Qwen3VisionConfig,
    Qwen3VLConfig,
    TextConfig,
    VisionConfig,
    build_model,
    init_weights,
    save_model,
)
from ..models.config3 import qwen3_text
from .tokenizer import write_tokenizer_files

TINY_PIXELS = dict(min_pixels=28 * 28, max_pixels=56 * 56)  # images become 4x4 patches -> 4 tokens
FAMILIES = ("qwen2_5_vl", "qwen3_vl")
# Qwen3-VL's 16-pixel patches: images become 4x4 patches -> 4 tokens, as above
TINY_PIXELS_QWEN3 = dict(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16)


def tiny_config(ids: dict[str, int]) -> ModelConfig:
    text = TextConfig(
        vocab_size=ids["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, mrope_section=(4, 6, 6),
        max_position_embeddings=4096, tie_word_embeddings=False,
    )
    vision = VisionConfig(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=4, window_size=56, out_hidden_size=128,
        fullatt_block_indexes=(1, 3), tokens_per_second=2,
    )
    return ModelConfig(
        text=text, vision=vision, image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
    )


def tiny_qwen3_config(ids: dict[str, int]) -> Qwen3VLConfig:
    """A tiny Qwen3-VL: head dim 64 (not hidden / heads = 32), three DeepStack layers of four."""
    text = qwen3_text(
        vocab_size=ids["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, explicit_head_dim=64, rope_theta=10000.0,
        mrope_section=(12, 10, 10), max_position_embeddings=4096, tie_word_embeddings=False,
    )
    vision = Qwen3VisionConfig(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
        num_position_embeddings=64, deepstack_visual_indexes=(0, 2, 3),
    )
    return Qwen3VLConfig(
        text=text, vision=vision, image_token_id=ids["image_token_id"], video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"], vision_end_token_id=ids["vision_end_token_id"],
        bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"],
    )


def write_tiny(out_dir: str | os.PathLike, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {FAMILIES}")
    out = Path(out_dir)
    qwen3 = family == "qwen3_vl"
    ids = write_tokenizer_files(out, **(TINY_PIXELS_QWEN3 if qwen3 else TINY_PIXELS))
    cfg = tiny_qwen3_config(ids) if qwen3 else tiny_config(ids)
    model = init_weights(build_model(cfg), seed=seed, std=0.02)
    return save_model(model, out)


def tiny_path(cache_dir: str | os.PathLike | None = None, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    """Where `ensure_tiny` keeps the checkpoint of `family` (written or not): under `cache_dir`, else
    $ROLLPLEX_CACHE, else ~/.cache/rollplex."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny model family {family!r}; known: {FAMILIES}")
    root = Path(cache_dir or os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))
    return root / (f"tiny-seed{seed}" if family == "qwen2_5_vl" else f"tiny-{family}-seed{seed}")


def tiny_written(path: Path) -> bool:
    return (Path(path) / "model.safetensors").exists()


def ensure_tiny(cache_dir: str | os.PathLike | None = None, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    """Path of the embedded tiny checkpoint of `family`, writing it first if it is not there yet."""
    path = tiny_path(cache_dir, seed, family)
    root = path.parent
    if not tiny_written(path):
        tmp = root / f".{path.name}.{os.getpid()}"
        write_tiny(tmp, seed, family)
        tmp.replace(path) if not path.exists() else None
    return path

