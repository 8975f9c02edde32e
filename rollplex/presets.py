"""Model presets: the real shapes of Qwen2.5-VL-3B/7B/32B (random init, for benchmarks) and `tiny`.

`configs/<name>.json` holds each preset as an HF config.json; `resolve_model_config(name_or_dir)`
accepts either a preset name or a checkpoint directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from .models.config import ModelConfig, TextConfig, VisionConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _vl(text: TextConfig, **vision) -> ModelConfig:
    return ModelConfig(text=text, vision=VisionConfig(out_hidden_size=text.hidden_size, **vision))


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
}


def preset(name: str) -> ModelConfig:
    key = name.lower().removesuffix("-instruct").replace("qwen2_5", "qwen2.5")
    if key in PRESETS:
        return PRESETS[key]
    path = CONFIG_DIR / f"{key}.json"
    if path.exists():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)} or a checkpoint directory")


def write_preset_files(out_dir: Path = CONFIG_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, cfg in PRESETS.items():
        (out_dir / f"{name}.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")


if __name__ == "__main__":
    write_preset_files()
