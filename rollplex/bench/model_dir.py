"""A checkpoint directory an external engine (SGLang) can start on offline: a preset's shape, no weights.

SGLang starts on a directory. With `load_format="dummy"` it needs no weight files, but it still reads
config.json, and for a multimodal model it builds the HF processor (AutoProcessor) even with
`skip_tokenizer_init`, so the tokenizer and preprocessor files must be there too. `write_model_dir(cfg, out)`
writes, for a Qwen2.5-VL or Qwen3-VL config (a preset's shape):

    config.json                   cfg.to_hf_dict(): the released checkpoints' layout (Qwen3-VL: text_config /
                                  vision_config nested, rope_scaling with mrope_section and mrope_interleaved,
                                  which SGLang's get_rope reads to turn interleaved M-RoPE on)
    tokenizer.json, ...           Rollplex's embedded byte-level BPE (rollplex/tiny/tokenizer.py), padded
                                  with unreachable filler entries so that Qwen's special tokens land on
                                  the config's ids (<|endoftext|> at bos_token_id = 151643, <|image_pad|>
                                  at 151655, ...); text is not what the benchmarks send (token ids are)
    preprocessor_config.json      the family's image processor settings (patch, merge, temporal patch from
                                  the config; Qwen's default pixel bounds). Qwen3-VL's, as released: patch 16,
                                  mean and std 0.5, Qwen3VLProcessor with Qwen3VLVideoProcessor

The weights come from the trainer: SGLang's dummy weights are replaced by the policy's at the first
rollout (SGLangRollout copies the policy in before it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

from ..tiny.tokenizer import SPECIAL_TOKENS, build_tiny_tokenizer, special_token_ids, write_tokenizer_files

# Qwen2.5-VL's preprocessor_config.json pixel bounds
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384
# Qwen3-VL's (its "size": shortest_edge / longest_edge in pixels) and normalisation
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 65536, 16777216
QWEN3_MEAN = QWEN3_STD = [0.5, 0.5, 0.5]


def padded_tokenizer(first_special: int) -> Tokenizer:
    """The embedded BPE with filler entries up to id `first_special`, then Qwen's special tokens in order."""
    base = json.loads(build_tiny_tokenizer().to_str())
    vocab = base["model"]["vocab"]
    specials = {t["content"] for t in base["added_tokens"]}
    vocab = {k: v for k, v in vocab.items() if k not in specials}
    if first_special < len(vocab):
        raise ValueError(f"the special tokens cannot start at {first_special}: the BPE has {len(vocab)} entries")
    for i in range(len(vocab), first_special):
        vocab[f"<|filler_{i}|>"] = i  # no merge produces these: never emitted, never matched
    base["model"]["vocab"] = vocab
    base["added_tokens"] = []
    tok = Tokenizer.from_str(json.dumps(base))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_model_dir(cfg, out: str | os.PathLike) -> Path:
    """config.json + tokenizer + preprocessor files of `cfg` (a Qwen2.5-VL or Qwen3-VL config) in `out`."""
    family = getattr(cfg, "family", None)
    if family not in ("qwen2_5_vl", "qwen3_vl") or not hasattr(cfg, "to_hf_dict"):
        raise ValueError("write_model_dir takes a Qwen2.5-VL or Qwen3-VL config "
                         "(rollplex.presets.preset('qwen2.5-vl-3b') or preset('qwen3-vl-4b'))")
    qwen3 = family == "qwen3_vl"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = padded_tokenizer(cfg.bos_token_id)
    ids = special_token_ids(tok)
    want = {k: getattr(cfg, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                         "vision_end_token_id", "eos_token_id", "bos_token_id")}
    wrong = {k: (ids[k], v) for k, v in want.items() if ids[k] != v}
    if wrong:
        raise ValueError(f"the config's special token ids are not Qwen's order from bos_token_id: {wrong}")
    v = cfg.vision
    write_tokenizer_files(out, tokenizer=tok, min_pixels=QWEN3_MIN_PIXELS if qwen3 else MIN_PIXELS,
                          max_pixels=QWEN3_MAX_PIXELS if qwen3 else MAX_PIXELS,
                          patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                          merge_size=v.spatial_merge_size)
    if qwen3:
        _as_qwen3_processor(out)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    return out


def _as_qwen3_processor(out: Path) -> None:
    """The processor files as the released Qwen3-VL checkpoints name them (Qwen3VLProcessor, mean/std 0.5)."""
    edits = {"tokenizer_config.json": {"processor_class": "Qwen3VLProcessor"},
             "preprocessor_config.json": {"processor_class": "Qwen3VLProcessor", "image_mean": QWEN3_MEAN,
                                          "image_std": QWEN3_STD},
             "video_preprocessor_config.json": {"processor_class": "Qwen3VLProcessor", "image_mean": QWEN3_MEAN,
                                                "image_std": QWEN3_STD,
                                                "video_processor_type": "Qwen3VLVideoProcessor"}}
    for name, fields in edits.items():
        path = out / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2) + "\n")
