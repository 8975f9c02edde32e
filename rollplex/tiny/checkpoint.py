"""The embedded tiny Qwen2.5-VL checkpoint (`python -m rollplex.tiny OUT_DIR [--seed N]` writes one).

An ordinary HF directory (config.json, model.safetensors, tokenizer files, chat template,
preprocessor_config.json) with random weights: every code path of the real model (window + full
vision attention, M-RoPE, GQA, untied head) at a size that trains on two CPU cores. Anything that
takes `--model` accepts it; `ensure_tiny()` creates it on first use under ~/.cache/rollplex.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..models import ModelConfig, Qwen25VL, TextConfig, VisionConfig, init_weights, save_model
from .tokenizer import write_tokenizer_files

TINY_PIXELS = dict(min_pixels=28 * 28, max_pixels=56 * 56)  # images become 4x4 patches -> 4 tokens


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


def write_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    out = Path(out_dir)
    ids = write_tokenizer_files(out, **TINY_PIXELS)
    model = init_weights(Qwen25VL(tiny_config(ids)), seed=seed, std=0.02)
    return save_model(model, out)


def ensure_tiny(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Path of the embedded tiny checkpoint, writing it first if it is not there yet."""
    root = Path(cache_dir or os.environ.get("ROLLPLEX_CACHE", Path.home() / ".cache" / "rollplex"))
    path = root / f"tiny-seed{seed}"
    if not (path / "model.safetensors").exists():
        tmp = root / f".tiny-seed{seed}.{os.getpid()}"
        write_tiny(tmp, seed)
        tmp.replace(path) if not path.exists() else None
    return path

