"""Tests for rollplex.tiny.tokenizer and rollplex.processor (CPU, no torchvision)."""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import os
import subprocess
import sys
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from rollplex.models import ModelInputs
from rollplex.processor import VLProcessor
from rollplex.tiny.tokenizer import (
    QWEN2_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tiny_tokenizer,
    special_token_ids,
    write_tokenizer_files,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_ckpt")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def proc(ckpt) -> VLProcessor:
    return VLProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def hf_image_processor(ckpt) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil.from_pretrained(ckpt)


def rand_image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------- tokenizer


def _tokenizer_digest() -> str:
    return hashlib.sha256(build_tiny_tokenizer().to_str().encode()).hexdigest()


def test_tokenizer_is_deterministic_across_processes():
    here = _tokenizer_digest()
    assert here == _tokenizer_digest()
    code = (
        "import hashlib; from rollplex.tiny.tokenizer import build_tiny_tokenizer as b; "
        "print(hashlib.sha256(b().to_str().encode()).hexdigest())"
    )
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == here


@pytest.mark.parametrize(
    "text",
    [
        "What color is the circle? The answer is 3.",
        "<think>count: 1, 2, 3</think> so the answer is blue",
        "  leading/trailing  spaces\n\n\tand tabs\r\n",
        "héllo wörld – ünïcode “quotes” 日本語 中文 한국어 🎉🧪 \u200b zero-width",
        "".join(chr(c) for c in range(32, 0x250)),
    ],
)
def test_tokenizer_round_trip(text):
    tok = build_tiny_tokenizer()
    text = unicodedata.normalize("NFC", text)  # Qwen2's normalizer is NFC
    assert tok.decode(tok.encode(text).ids) == text
    with_specials = f"<|im_start|>user\n{text}<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    ids = tok.encode(with_specials).ids
    assert tok.decode(ids, skip_special_tokens=False) == with_specials
    assert tok.decode(ids, skip_special_tokens=True) == f"user\n{text}"


def test_special_token_ids_contiguous():
    tok = build_tiny_tokenizer()
    n_bpe = tok.get_vocab_size(with_added_tokens=False)
    assert 450 <= n_bpe <= 550
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(n_bpe, n_bpe + len(SPECIAL_TOKENS)))
    ids = special_token_ids(tok)
    assert ids["bos_token_id"] == ids["pad_token_id"] == tok.token_to_id("<|endoftext|>") == n_bpe
    assert ids["eos_token_id"] == n_bpe + 2
    assert (ids["vision_start_token_id"], ids["vision_end_token_id"]) == (n_bpe + 9, n_bpe + 10)
    assert (ids["image_token_id"], ids["video_token_id"]) == (n_bpe + 12, n_bpe + 13)
    assert ids["vocab_size"] % 64 == 0 and ids["vocab_size"] >= tok.get_vocab_size()
    # specials are atomic: one id each, never split
    assert tok.encode("<|image_pad|><|image_pad|>").ids == [ids["image_token_id"]] * 2


def test_autotokenizer_loads_written_files(ckpt):
    tok = build_tiny_tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert hf.is_fast
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    assert hf.model_max_length == 32768
    assert hf.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert len(hf) == tok.get_vocab_size()
    text = "<|im_start|>user\nWhat is green? héllo 🎉<|vision_start|><|image_pad|><|vision_end|><|im_end|>"
    assert hf(text, add_special_tokens=True)["input_ids"] == tok.encode(text).ids
    assert hf.decode(tok.encode(text).ids) == text
    assert hf.chat_template == QWEN2_VL_CHAT_TEMPLATE
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja"):
        assert (ckpt / name).is_file()


# ---------------------------------------------------------------- chat template


def test_chat_template_exact(proc, ckpt):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is it?"}]}]
    expected = (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color is it?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert proc.apply_chat_template(msgs) == expected
    no_gen = expected[: -len("<|im_start|>assistant\n")]
    assert proc.apply_chat_template(msgs, add_generation_prompt=False) == no_gen
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == expected

    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "How many?"}]},
        {"role": "assistant", "content": "3"},
    ]
    assert proc.apply_chat_template(conv, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>How many?<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n"
    )
    # verl-style string content with <image> markers
    verl = [{"role": "user", "content": "<image>What color is it?"}]
    assert proc.apply_chat_template(verl) == expected


# ---------------------------------------------------------------- images


def _hf_num_pad_tokens(hf_ip, grid_thw: torch.Tensor) -> list[int]:
    """Pad count from transformers' own Qwen2_5_VLProcessor.replace_image_token."""
    fake = SimpleNamespace(image_processor=hf_ip, image_token="<|image_pad|>")
    feats = {"image_grid_thw": grid_thw}
    pads = [Qwen2_5_VLProcessor.replace_image_token(fake, feats, i) for i in range(len(grid_thw))]
    return [p.count("<|image_pad|>") for p in pads]


@pytest.mark.parametrize("sizes", [[(61, 93)], [(61, 93), (150, 40)], [(400, 300), (12, 30), (56, 56)]])
def test_image_inputs_match_transformers(proc, hf_image_processor, sizes):
    images = [rand_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    content = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "Which is red?"}]
    out = proc.encode(messages=[{"role": "user", "content": content}])
    ref = hf_image_processor(images=images, return_tensors="pt")
    assert out.pixel_values.dtype == torch.float32 and out.image_grid_thw.dtype == torch.long
    assert out.pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert torch.equal(out.pixel_values, ref["pixel_values"])
    assert torch.equal(out.image_grid_thw, ref["image_grid_thw"])
    n_pad = [int(g.prod()) // 4 for g in out.image_grid_thw]
    assert n_pad == _hf_num_pad_tokens(hf_image_processor, ref["image_grid_thw"])
    assert out.input_ids.count(proc.image_token_id) == sum(n_pad)
    assert out.pixel_values_videos is None and out.video_grid_thw is None and out.second_per_grid_ts is None
    # placeholders expand in place, each as one contiguous run between vision_start / vision_end
    ids = out.input_ids
    starts = [i for i, t in enumerate(ids) if t == proc.vision_start_token_id]
    spans = list(zip(starts, n_pad, strict=True))
    assert [ids[s + 1 + n] for s, n in spans] == [proc.vision_end_token_id] * len(images)
    assert all(set(ids[s + 1 : s + 1 + n]) == {proc.image_token_id} for s, n in spans)


def test_text_and_message_paths_agree(proc):
    images = [rand_image(61, 93), rand_image(150, 40, seed=1)]
    msgs = [{"role": "user", "content": "<image>and<image>which is red?"}]
    a = proc.encode(messages=msgs, images=images)
    b = proc.encode(text=proc.apply_chat_template(msgs), images=images)
    typed = [{"type": "image", "image": images[0]}, {"type": "text", "text": "and"},
             {"type": "image", "image": images[1]}, {"type": "text", "text": "which is red?"}]
    c = proc.encode(messages=[{"role": "user", "content": typed}])
    for x in (b, c):
        assert x.input_ids == a.input_ids
        assert torch.equal(x.pixel_values, a.pixel_values) and torch.equal(x.image_grid_thw, a.image_grid_thw)
    expected = "system\nYou are a helpful assistant.\nuser\nandwhich is red?\nassistant\n"
    assert proc.decode(a.input_ids) == expected


def test_load_image_accepts_all_forms(proc, tmp_path):
    img = rand_image(33, 21)
    data = png_bytes(img)
    path = tmp_path / "x.png"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    url = f"data:image/png;base64,{b64}"
    forms = [img, np.asarray(img), str(path), path, f"file://{path}", data, b64, url, {"url": url}]
    for f in forms:
        assert np.array_equal(np.asarray(proc.load_image(f).convert("RGB")), np.asarray(img)), type(f)


@pytest.mark.parametrize(
    "bad",
    ["not base64 at all!!", "aGVsbG8gd29ybGQ=", "data:image/png;base64,@@@@", "data:image/png,rawdata",
     b"\x89PNG garbage", "https://example.com/a.png", "/no/such/file.png", 123],
)
def test_load_image_rejects_garbage(proc, bad):
    with pytest.raises(ValueError):
        proc.load_image(bad)
    with pytest.raises(ValueError):
        proc.encode(messages=[{"role": "user", "content": [{"type": "image", "image": bad}]}])


def test_count_mismatch_raises(proc):
    im = rand_image(40, 40)
    one = "<|vision_start|><|image_pad|><|vision_end|>hi"
    with pytest.raises(ValueError):
        proc.encode(text=one)
    with pytest.raises(ValueError):
        proc.encode(text=one, images=[im, im])
    with pytest.raises(ValueError):
        proc.encode(text=one, images=[im], videos=[[im, im]])
    with pytest.raises(ValueError):
        proc.encode(messages=[{"role": "user", "content": "<image><image>"}], images=[im])
    with pytest.raises(ValueError):
        proc.encode(messages=[{"role": "user", "content": "<video>"}], images=[im])
    with pytest.raises(ValueError):
        proc.encode(messages=[{"role": "user", "content": [{"type": "image", "image": im}]}], images=[im])
    with pytest.raises(ValueError):
        proc.encode(text="x", messages=[{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- videos


def _transformers_video_patchify():
    """Qwen2VLVideoProcessor.patchify, taken from transformers' source (its module imports torchvision)."""
    src = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"
    cls = next(n for n in ast.parse(src.read_text()).body
               if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "patchify")
    ns: dict = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src), "exec"), ns)
    return ns["patchify"]


def _normalized_frames(ip: Qwen2VLImageProcessorPil, frames: list[Image.Image]) -> torch.Tensor:
    """Frames resized/rescaled/normalised by the PIL processor's own methods -> [1, F, C, H, W]."""
    out = []
    for f in frames:
        x = ip.process_image(f, do_convert_rgb=True)
        x = ip.resize(x, size=ip.size, resample=ip.resample, factor=ip.patch_size * ip.merge_size)
        x = ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std)
        out.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    return torch.stack(out)[None]


@pytest.mark.parametrize("n_frames,size", [(4, (61, 93)), (3, (150, 40)), (1, (70, 50)), (5, (300, 200))])
def test_video_matches_qwen2vl_video_layout(proc, hf_image_processor, n_frames, size):
    frames = [rand_image(*size, seed=10 + i) for i in range(n_frames)]
    out = proc.encode(messages=[{"role": "user", "content": [{"type": "video", "video": frames}]}], fps=4.0)
    ref_frames = _normalized_frames(hf_image_processor, frames)
    patches, t, h, w = _transformers_video_patchify()(None, ref_frames, 14, 2, 2)
    assert out.video_grid_thw.tolist() == [[t, h, w]] and t == (n_frames + 1) // 2
    assert out.pixel_values_videos.dtype == torch.float32
    torch.testing.assert_close(out.pixel_values_videos, patches[0], rtol=0, atol=1e-6)
    assert out.second_per_grid_ts == [0.5]
    assert out.input_ids.count(proc.video_token_id) == t * h * w // 4
    assert out.pixel_values is None


def test_video_of_repeated_frames_equals_images(proc, hf_image_processor):
    a, b = rand_image(61, 93, seed=1), rand_image(61, 93, seed=2)
    one = proc.encode(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[[a, a]])
    ref_a = hf_image_processor(images=[a], return_tensors="pt")["pixel_values"]
    assert torch.equal(one.pixel_values_videos, ref_a)
    two = proc.encode(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[[a, a, b, b]])
    ref = hf_image_processor(images=[a, b], return_tensors="pt")
    assert torch.equal(two.pixel_values_videos, ref["pixel_values"])
    assert two.video_grid_thw.tolist() == [[2, *ref["image_grid_thw"][0, 1:].tolist()]]
    assert two.second_per_grid_ts == [1.0]  # temporal_patch_size / default fps 2.0
    # odd frame count pads by repeating the last frame
    three = proc.encode(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[[a, a, b]])
    assert torch.equal(three.pixel_values_videos, two.pixel_values_videos)


def test_mixed_images_and_videos(proc):
    im, frames = rand_image(61, 93), [rand_image(40, 150, seed=s) for s in range(4)]
    arr_video = np.stack([np.asarray(f) for f in frames])  # a [T, H, W, C] array is a list of frames too
    out = proc.encode(messages=[{"role": "user", "content": "<video> vs <image> vs <video>"}],
                      images=[im], videos=[frames, arr_video])
    assert isinstance(out, ModelInputs)
    assert out.video_grid_thw.shape == (2, 3) and out.image_grid_thw.shape == (1, 3)
    n = out.video_grid_thw[0].prod().item()
    assert torch.equal(out.pixel_values_videos[:n], out.pixel_values_videos[n:])
    assert out.input_ids.count(proc.video_token_id) == 2 * n // 4
    with pytest.raises(ValueError):
        # frames of different sizes
        proc.encode(text="<|vision_start|><|video_pad|><|vision_end|>", videos=[[im, frames[0]]])
