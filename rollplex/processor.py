"""Chat messages + images/videos -> Qwen2.5-VL `ModelInputs`, without torchvision.

``VLProcessor`` reproduces what ``transformers.Qwen2_5_VLProcessor`` feeds the model:

* text comes from the checkpoint's chat template (or is given already templated); every
  ``<|image_pad|>`` / ``<|video_pad|>`` placeholder is expanded to ``grid_t * grid_h * grid_w // merge**2``
  pad tokens, exactly like ``Qwen2_5_VLProcessor.replace_image_token`` / ``replace_video_token``;
* images go through transformers' ``Qwen2VLImageProcessorPil`` (the PIL/numpy backend; the default
  torchvision backend is not installed here);
* videos: transformers' ``Qwen2VLVideoProcessor`` imports torchvision at module level (and
  ``BaseVideoProcessor`` requires it), so it cannot be built here. Each frame is instead resized /
  rescaled / normalised by the same PIL image processor (configured from video_preprocessor_config.json
  when present, like transformers), the frame count is padded to a multiple of ``temporal_patch_size``
  by repeating the last frame, and consecutive frames are packed into temporal patches. The result has
  the exact ``pixel_values_videos`` layout of ``Qwen2VLVideoProcessor.patchify``:
  rows ordered (t, h/merge, w/merge, merge_h, merge_w), columns (C, temporal, patch_h, patch_w), and
  ``video_grid_thw = (T / temporal_patch, H / patch, W / patch)``. Pixel values equal the PIL image path.
  Caveat (images too): transformers' torchvision backends resize with torch's bicubic kernel, not PIL's;
  on CPU uint8 the two differ by 1-2 levels on <1% of pixels, on the float/GPU path by more.
* ``second_per_grid_ts = temporal_patch_size / fps`` per video, as in ``Qwen2_5_VLProcessor``.
* Qwen3-VL checkpoints (``video_timestamps``, from config.json's ``model_type``): each video placeholder
  becomes one ``<{t:.1f} seconds><|vision_start|><|video_pad|>...<|vision_end|>`` block per temporal patch,
  ``t`` the mean time of its frames (frame i at i / fps), exactly ``Qwen3VLProcessor.replace_video_token``;
  the chat template's wrapper around the video is dropped, as there.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .models.inputs import ModelInputs

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
_VERL_PLACEHOLDER = re.compile(r"(<image>|<video>)")
# Keys of preprocessor_config.json / video_preprocessor_config.json that the PIL image processor takes.
_VISION_KEYS = (
    "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "resample", "image_mean",
    "image_std", "size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
)


def _vision_processor(cfg: dict[str, Any]) -> Qwen2VLImageProcessorPil:
    kwargs = {k: cfg[k] for k in _VISION_KEYS if k in cfg}
    if "size" in kwargs and ("min_pixels" in kwargs or "max_pixels" in kwargs):
        kwargs.pop("size")  # legacy keys win, as in Qwen2VLImageProcessor.__init__
    return Qwen2VLImageProcessorPil(**kwargs)


def load_image(x: Any) -> Image.Image:
    """PIL image from a PIL image, numpy array (HWC / HW), path, bytes, base64 string or data URL."""
    if isinstance(x, Image.Image):
        return x
    if isinstance(x, np.ndarray):
        try:
            return Image.fromarray(x)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot make an image of array {x.shape} {x.dtype}: {e}") from e
    if isinstance(x, dict):  # OpenAI {"url": ...} from an image_url item
        return load_image(x.get("url"))
    data: bytes
    if isinstance(x, (bytes, bytearray, memoryview)):
        data = bytes(x)
    elif isinstance(x, os.PathLike):
        data = _read_file(os.fspath(x))
    elif isinstance(x, str):
        s = x.strip()
        if s.startswith("data:"):
            header, sep, payload = s.partition(",")
            if not sep or not header.endswith(";base64"):
                raise ValueError(f"unsupported data URL (expected data:<mime>;base64,...): {s[:40]!r}")
            data = _b64decode(payload)
        elif s.startswith(("http://", "https://")):
            raise ValueError(f"remote image URLs are not fetched; pass the image bytes instead: {s[:80]!r}")
        elif s.startswith("file://"):
            data = _read_file(s[len("file://"):])
        elif len(s) < 4096 and os.path.isfile(s):
            data = _read_file(s)
        else:
            data = _b64decode(s)
    else:
        raise ValueError(f"cannot load an image from {type(x).__name__}")
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError, SyntaxError...
        raise ValueError(f"could not decode image data ({len(data)} bytes): {e}") from e
    return img


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cannot read image file {path!r}: {e}") from e


def _b64decode(s: str) -> bytes:
    try:
        return base64.b64decode("".join(s.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"not an image path, data URL or valid base64 string: {s[:40]!r}...") from e


class VLProcessor:
    """Tokenizer + chat template + Qwen2-VL image/video preprocessing for one checkpoint."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        image_processor: Qwen2VLImageProcessorPil,
        video_processor: Qwen2VLImageProcessorPil | None = None,
        chat_template: str | None = None,
        video_timestamps: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor if video_processor is not None else image_processor
        self.video_timestamps = video_timestamps  # Qwen3-VL's video layout (module docstring)
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.chat_template:
            raise ValueError("no chat template: pass one or use a checkpoint with chat_template.jinja")

        def tid(token: str) -> int:
            i = tokenizer.convert_tokens_to_ids(token)
            if i is None or i == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer lacks {token}")
            return int(i)

        self.image_token_id = tid("<|image_pad|>")
        self.video_token_id = tid("<|video_pad|>")
        self.vision_start_token_id = tid("<|vision_start|>")
        self.vision_end_token_id = tid("<|vision_end|>")
        self.eos_token_id = int(tokenizer.eos_token_id)
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> VLProcessor:
        path = os.fspath(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        with open(os.path.join(path, "preprocessor_config.json"), encoding="utf-8") as f:
            image_cfg = json.load(f)
        video_path = os.path.join(path, "video_preprocessor_config.json")
        video_cfg = image_cfg
        if os.path.isfile(video_path):  # transformers falls back to preprocessor_config.json likewise
            with open(video_path, encoding="utf-8") as f:
                video_cfg = json.load(f)
        template = None
        for name in ("chat_template.jinja", "chat_template.json"):
            p = os.path.join(path, name)
            if os.path.isfile(p):
                with open(p, encoding="utf-8") as f:
                    template = f.read() if name.endswith(".jinja") else json.load(f)["chat_template"]
                break
        from .models.config import model_type

        timestamps = os.path.isfile(os.path.join(path, "config.json")) and model_type(path) == "qwen3_vl"
        return cls(tokenizer, _vision_processor(image_cfg), _vision_processor(video_cfg), template, timestamps)

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    load_image = staticmethod(load_image)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            _normalize_messages(messages), chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(
        self,
        text: str | None = None,
        messages: list[dict] | None = None,
        images: list | None = None,
        videos: list | None = None,
        fps: float = 2.0,
    ) -> ModelInputs:
        if (text is None) == (messages is None):
            raise ValueError("pass exactly one of `text` or `messages`")
        if messages is not None:
            messages = _normalize_messages(messages)
            images, videos = _collect_media(messages, list(images or []), list(videos or []))
            text = self.apply_chat_template(messages, add_generation_prompt=True)
        images, videos = list(images or []), list(videos or [])
        if fps <= 0:
            raise ValueError(f"fps must be positive, got {fps}")
        frames = [1] * len(videos)  # pad runs per video: one, or one per temporal patch (timestamps)
        if self.video_timestamps and videos:
            text, frames = self._timestamped(text, videos, fps)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        n_img, n_vid = ids.count(self.image_token_id), ids.count(self.video_token_id)
        if n_img != len(images) or n_vid != sum(frames):
            raise ValueError(
                f"prompt has {n_img} image and {n_vid} video placeholders but got {len(images)} images and "
                f"{len(videos)} videos"
            )
        out = ModelInputs(input_ids=[])
        counts: dict[int, list[int]] = {self.image_token_id: [], self.video_token_id: []}
        if images:
            feats = self.image_processor(images=[load_image(x) for x in images], return_tensors="pt")
            out.pixel_values = feats["pixel_values"].to(torch.float32)
            out.image_grid_thw = feats["image_grid_thw"].to(torch.long)
            merge = int(self.image_processor.merge_size) ** 2
            counts[self.image_token_id] = [int(g.prod()) // merge for g in out.image_grid_thw]
        if videos:
            pv, grids = zip(*(self._video_patches(v) for v in videos))
            out.pixel_values_videos = torch.from_numpy(np.concatenate(pv, axis=0))
            out.video_grid_thw = torch.tensor(grids, dtype=torch.long)
            out.second_per_grid_ts = [self.video_processor.temporal_patch_size / fps] * len(videos)
            merge = int(self.video_processor.merge_size) ** 2
            if self.video_timestamps:  # one pad run per temporal patch
                counts[self.video_token_id] = [int(h * w) // merge for t, h, w in out.video_grid_thw for _ in range(t)]
            else:
                counts[self.video_token_id] = [int(g.prod()) // merge for g in out.video_grid_thw]
        pending = {k: iter(v) for k, v in counts.items()}
        for i in ids:
            out.input_ids.extend([i] * next(pending[i]) if i in pending else [i])
        return out

    def _timestamped(self, text: str, videos: list, fps: float) -> tuple[str, list[int]]:
        """`text` with each video placeholder as Qwen3-VL's timestamped frame blocks (one pad token per
        block, expanded after tokenization), and the number of blocks of each video."""
        text = text.replace(VIDEO_PLACEHOLDER, "<|video_pad|>")  # the template's wrapper: each block has its own
        parts = text.split("<|video_pad|>")
        if len(parts) - 1 != len(videos):
            raise ValueError(f"prompt has {len(parts) - 1} video placeholders but got {len(videos)} videos")
        t_patch = int(self.video_processor.temporal_patch_size)
        out, frames = [parts[0]], []
        for video, rest in zip(videos, parts[1:]):
            n = 1 if isinstance(video, (str, bytes)) else len(list(video))
            idx = list(range(n)) + [n - 1] * (-n % t_patch)  # padded by the last frame, as the patches are
            stamps = [(idx[i] + idx[i + t_patch - 1]) / 2 / fps for i in range(0, len(idx), t_patch)]
            out += [f"<{s:.1f} seconds>{VIDEO_PLACEHOLDER}" for s in stamps] + [rest]
            frames.append(len(stamps))
        return "".join(out), frames

    def _video_patches(self, video: Any) -> tuple[np.ndarray, list[int]]:
        """Qwen2VLVideoProcessor's pixel_values_videos for one video (list of frames), via the PIL path."""
        frames = [load_image(f) for f in (list(video) if not isinstance(video, (str, bytes)) else [video])]
        if not frames:
            raise ValueError("a video needs at least one frame")
        if len(sizes := {f.size for f in frames}) != 1:
            raise ValueError(f"all frames of a video must have the same size, got {sorted(sizes)}")
        vp = self.video_processor
        t_patch = int(vp.temporal_patch_size)
        feats = vp(images=frames, return_tensors="np")
        _, gh, gw = (int(v) for v in feats["image_grid_thw"][0])
        c = feats["pixel_values"].shape[1] // (t_patch * int(vp.patch_size) ** 2)
        # per frame: [gh*gw, C, T, P*P] with the frame broadcast over T; keep one temporal copy
        per_frame = feats["pixel_values"].reshape(len(frames), gh * gw, c, t_patch, -1)[:, :, :, 0]
        if pad := -len(frames) % t_patch:  # repeat the last frame, like Qwen2VLVideoProcessor.patchify
            per_frame = np.concatenate([per_frame, np.repeat(per_frame[-1:], pad, axis=0)], axis=0)
        grid_t = per_frame.shape[0] // t_patch
        # (grid_t, T, N, C, PP) -> (grid_t, N, C, T, PP): rows (t, h/m, w/m, m, m), cols (C, T, P, P)
        patches = per_frame.reshape(grid_t, t_patch, gh * gw, c, -1).transpose(0, 2, 3, 1, 4)
        return np.ascontiguousarray(patches.reshape(grid_t * gh * gw, -1), dtype=np.float32), [grid_t, gh, gw]


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """Turn verl-style string content with <image>/<video> markers into typed content lists."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and _VERL_PLACEHOLDER.search(content):
            items: list[dict] = []
            for piece in _VERL_PLACEHOLDER.split(content):
                if piece in ("<image>", "<video>"):
                    items.append({"type": piece[1:-1]})
                elif piece:
                    items.append({"type": "text", "text": piece})
            m = {**m, "content": items}
        out.append(m)
    return out


def _collect_media(messages: list[dict], images: list, videos: list) -> tuple[list, list]:
    """Media in content order: an item's own payload, else the next one from `images` / `videos`."""
    got_images, got_videos = [], []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            if item.get("type") == "image" or "image" in item or "image_url" in item:
                payload = item.get("image", item.get("image_url"))
                if payload is None and not images:
                    raise ValueError("more image items in messages than images given")
                got_images.append(payload if payload is not None else images.pop(0))
            elif item.get("type") == "video" or "video" in item:
                payload = item.get("video")
                if payload is None and not videos:
                    raise ValueError("more video items in messages than videos given")
                got_videos.append(payload if payload is not None else videos.pop(0))
    if images or videos:
        raise ValueError(f"{len(images)} images and {len(videos)} videos were not referenced by the messages")
    return got_images, got_videos
