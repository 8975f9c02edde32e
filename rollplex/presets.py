"""Model presets: the real shapes of Qwen2.5-VL-3B/7B/32B and Qwen3-VL-2B/4B/8B with RANDOM weights, for
benchmarks.

A preset is only a shape: `preset(name)` is its ModelConfig and `random_model(name)` builds it with
random weights (and no tokenizer). Such a model answers noise, so `random_model` logs a warning that
names the preset and how to load the real weights: a checkpoint directory, or a Hugging Face model id
(`Qwen/Qwen2.5-VL-3B-Instruct`) from the local cache (rollplex/models/hub.py).
`configs/<name>.json` holds each preset as an HF config.json (`python -m rollplex.presets` writes them).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .models.config import ModelConfig, TextConfig, VisionConfig
from .models.config3 import Qwen3VisionConfig, Qwen3VLConfig, qwen3_text

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
log = logging.getLogger("rollplex.presets")


def _vl(text: TextConfig, **vision) -> ModelConfig:
    return ModelConfig(text=text, vision=VisionConfig(out_hidden_size=text.hidden_size, **vision))


def _vl3(text: TextConfig, **vision) -> Qwen3VLConfig:
    return Qwen3VLConfig(text=text, vision=Qwen3VisionConfig(out_hidden_size=text.hidden_size, **vision))


# the Qwen3-VL towers: 2B and 4B share one (24 blocks of 1024), 8B has SigLIP-so400m's shape
_VIT3_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=(5, 11, 17))
_VIT3_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, deepstack_visual_indexes=(8, 16, 24))

PRESETS: dict[str, ModelConfig] = {
    "qwen2.5-vl-3b": _vl(TextConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                                    num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                                    tie_word_embeddings=True)),
    "qwen2.5-vl-7b": _vl(TextConfig(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                    tie_word_embeddings=False)),
    "qwen2.5-vl-32b": _vl(TextConfig(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                     num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                                     tie_word_embeddings=False)),
    "qwen3-vl-2b": _vl3(qwen3_text(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                   num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
                        **_VIT3_SMALL),
    "qwen3-vl-4b": _vl3(qwen3_text(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
                        **_VIT3_SMALL),
    "qwen3-vl-8b": _vl3(qwen3_text(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
                        **_VIT3_LARGE),
}
# the released checkpoints with these shapes
HUB_IDS = {"qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct", "qwen2.5-vl-7b": "Qwen/Qwen2.5-VL-7B-Instruct",
           "qwen2.5-vl-32b": "Qwen/Qwen2.5-VL-32B-Instruct", "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
           "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct", "qwen3-vl-8b": "Qwen/Qwen3-VL-8B-Instruct"}


def preset(name: str) -> ModelConfig:
    key = _key(name)
    if key in PRESETS:
        return PRESETS[key]
    path = CONFIG_DIR / f"{key}.json"
    if path.exists():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}, a checkpoint directory "
                     "or a Hugging Face model id (org/name)")


def _key(name: str) -> str:
    return name.lower().removesuffix("-instruct").replace("qwen2_5", "qwen2.5")


def random_weights_warning(name: str) -> str:
    real = HUB_IDS.get(_key(name))
    example = f"--model {real} (fill the cache with `huggingface-cli download {real}`)" if real else \
        "--model ORG/NAME"
    return (f"model preset {name!r} has RANDOM weights (the real shapes, untrained): its answers are noise, "
            f"it is meant for benchmarks. For real weights pass a checkpoint directory, or a Hugging Face model "
            f"id from the local cache: {example}")


def random_model(name: str, device="cpu", dtype=None, seed: int = 0):
    """The preset's model with random weights (seeded) on `device`, in `dtype` (default float32); logs
    `random_weights_warning`."""
    import torch

    from .models import build_model, init_weights
    from .models.hf_io import empty_model

    cfg = preset(name)
    log.warning("%s", random_weights_warning(name))
    if torch.device(device).type == "cpu":  # the CPU draw order and float32 rounding every test relies on
        with torch.device(device):
            model = init_weights(build_model(cfg), seed=seed, std=0.02)
        return model.to(dtype or torch.float32)
    # on an accelerator: the parameters are allocated once in `dtype` and drawn there (a float32 draw rounds
    # into them exactly as a float32 model cast to `dtype` would), without a default init to overwrite
    return init_weights(empty_model(cfg, device, dtype or torch.float32), seed=seed, std=0.02)


def write_preset_files(out_dir: Path = CONFIG_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, cfg in PRESETS.items():
        (out_dir / f"{name}.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")


if __name__ == "__main__":
    write_preset_files()
