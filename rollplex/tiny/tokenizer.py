"""Embedded tiny tokenizer, chat template and preprocessor config for tiny Qwen2.5-VL checkpoints.

Tests and local experiments need a complete Hugging Face style checkpoint directory (weights *and*
tokenizer/processor files) without downloading anything. This module builds one deterministically:

* ``build_tiny_tokenizer`` trains a byte-level BPE on a small embedded English corpus (colors, shapes,
  digits, question words, ``<think>``...). The normalizer / pre-tokenizer / decoder are exactly the ones
  ``transformers.Qwen2Tokenizer`` rebuilds when it loads a checkpoint (NFC + Qwen2 split regex +
  ``ByteLevel(use_regex=False)``), so ids are identical whether the file is read with ``tokenizers`` or
  with ``transformers.AutoTokenizer``. Byte-level BPE means every NFC string round-trips through
  encode/decode. The BPE part has ``BPE_VOCAB_SIZE`` entries (256 byte symbols + merges); Qwen2.5-VL's 14
  special tokens follow contiguously, in Qwen's own order, so the real vocab has 512 entries.
* ``QWEN2_VL_CHAT_TEMPLATE`` is the Qwen2-VL / Qwen2.5-VL chat template (the jinja shipped with the
  Qwen checkpoints), stored as data.
* ``write_tokenizer_files`` writes tokenizer.json, tokenizer_config.json, special_tokens_map.json,
  chat_template.jinja (+ legacy chat_template.json), preprocessor_config.json and
  video_preprocessor_config.json into a checkpoint directory.

Training is deterministic: the BPE trainer breaks count ties by symbol ids (no hash-order dependence),
and the corpus is a fixed string. ``tests/test_processor.py`` checks this across processes.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Same split regex as transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (Qwen2 / Qwen2.5).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

BPE_VOCAB_SIZE = 498  # 256 byte symbols + 242 merges; + 14 specials = 512 = 8 * 64
MODEL_MAX_LENGTH = 32768

_CORPUS_WORDS = """
What is the color of the shape? What color is the circle? What shape is red? How many shapes are there?
How many circles are in the image? How many squares are blue? Which shape is the largest? Is the triangle
green? Is there a yellow square? The answer is 3. The answer is red. The answer is circle. Count the
objects and give the answer. There are 2 red circles, 1 blue square and 4 green triangles.
red green blue yellow orange purple black white gray pink brown cyan magenta
circle square triangle rectangle star hexagon diamond ellipse line dot
zero one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9 10 12 24 100
<think> </think> <answer> </answer> Let me think step by step. First, I look at the image.
Then I count the shapes. So the final answer is
You are a helpful assistant. Please answer the question about the picture. Describe this image.
the a an of and to in is it that this with for on as are be at by from or not but have has
what which who where when why how many much more most some any all each every no yes
image picture video frame left right top bottom middle center above below next near small large big
count number answer question color shape size position there here one only also very
"""

_CHAT_LINES = """
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What color is the circle?<|im_end|>
<|im_start|>assistant
<think>I see a red circle.</think> The answer is red.<|im_end|>
"""


def _corpus() -> list[str]:
    """The fixed training corpus, repeated with variations so common words get merged."""
    lines = [ln.strip() for ln in _CORPUS_WORDS.strip().splitlines() if ln.strip()]
    colors = ["red", "green", "blue", "yellow", "orange", "purple", "black", "white"]
    shapes = ["circle", "square", "triangle", "rectangle", "star", "hexagon"]
    extra = []
    for i, color in enumerate(colors):
        for j, shape in enumerate(shapes):
            n = (i * len(shapes) + j) % 10
            extra.append(f"What color is the {shape}? The {shape} is {color}. How many? {n}")
            extra.append(f"There are {n} {color} {shape}s. The answer is {n}.")
    return lines * 4 + extra + [_CHAT_LINES] * 2


def build_tiny_tokenizer() -> Tokenizer:
    """Train (deterministically) the tiny byte-level BPE and append Qwen2.5-VL's special tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"tiny corpus produced {tok.get_vocab_size()} BPE entries, want {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """Ids of the tokens the model config needs, plus ``vocab_size`` rounded up to a multiple of 64."""

    def tid(token: str) -> int:
        i = tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer lacks special token {token}")
        return i

    real = tokenizer.get_vocab_size(with_added_tokens=True)
    return {
        "bos_token_id": tid("<|endoftext|>"),
        "eos_token_id": tid("<|im_end|>"),
        "pad_token_id": tid("<|endoftext|>"),
        "im_start_token_id": tid("<|im_start|>"),
        "image_token_id": tid("<|image_pad|>"),
        "video_token_id": tid("<|video_pad|>"),
        "vision_start_token_id": tid("<|vision_start|>"),
        "vision_end_token_id": tid("<|vision_end|>"),
        "vision_token_id": tid("<|vision_pad|>"),
        "vocab_size": -(-real // 64) * 64,
    }


# The chat template of Qwen2-VL-*-Instruct / Qwen2.5-VL-*-Instruct (chat_template.json), verbatim.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_tokenizer_files(
    out_dir: str | os.PathLike,
    *,
    tokenizer: Tokenizer | None = None,
    min_pixels: int = 56 * 56,
    max_pixels: int = 112 * 112 * 4,
    patch_size: int = 14,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    fps: float = 2.0,
) -> dict[str, int]:
    """Write tokenizer + chat template + image/video preprocessor configs; returns ``special_token_ids``."""
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    tok.save(os.path.join(out, "tokenizer.json"))
    ids = special_token_ids(tok)

    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    _write_json(os.path.join(out, "tokenizer_config.json"), {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "processor_class": "Qwen2_5_VLProcessor",
    })
    _write_json(os.path.join(out, "special_tokens_map.json"), {
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    })
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN2_VL_CHAT_TEMPLATE)
    # transformers 4.x processors read the template from chat_template.json.
    _write_json(os.path.join(out, "chat_template.json"), {"chat_template": QWEN2_VL_CHAT_TEMPLATE})

    vision = {
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,  # PIL.Image.BICUBIC
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "merge_size": merge_size,
        "processor_class": "Qwen2_5_VLProcessor",
    }
    _write_json(os.path.join(out, "preprocessor_config.json"),
                {**vision, "image_processor_type": "Qwen2VLImageProcessor"})
    _write_json(os.path.join(out, "video_preprocessor_config.json"),
                {**vision, "video_processor_type": "Qwen2VLVideoProcessor", "fps": fps,
                 "do_sample_frames": False})
    return ids
