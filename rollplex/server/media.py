"""Images and video frames a request names -> decoded PIL images, under the server's media policy.

    media = MediaPolicy(limits, root)        # root: --media-root, or None (no local files at all)
    media.prompt(images, videos)             # (images, videos) as PIL images, ValueError otherwise
    media.chat(messages)                     # messages whose content items carry PIL images

The server resolves every media reference of a request here, on an intake thread, and hands the
processor decoded images only, so the library's `load_image` (which reads any path it is given, for
trusted in-process callers) never sees a client's string.

A reference is a data URL, a base64 string, or a local file: `file://PATH` or any other string
that is not valid base64. Remote URLs are refused. Local files are read only when the server was
started with a media root, and then only regular files inside it after `..` and symlinks are
resolved (like /save's checkpoint root). Without a root no path is looked up at all, and every
failure to read a file (missing, outside the root, not a regular file, unreadable) gets the one
message, so an answer never tells a client whether or how large a file is. A file's size is checked
on the open descriptor and at most max_image_bytes + 1 bytes are read (a FIFO or /dev/zero is refused
before any read; opened non-blocking so that a FIFO cannot hang the intake thread).

Decoding: only common raster formats (PIL's EPS plugin, for one, would run Ghostscript); the size
from the header is checked against max_image_pixels, and a prompt's images and frames together
against max_prompt_pixels, before the pixels are decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from pathlib import Path

from PIL import Image

from .limits import ServerLimits, flag
from .schemas import _image_ref

FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
NO_ROOT = ("not a data URL or base64 image, and local files are not read by this server (it reads files only "
           "under a --media-root, which it was started without): send the image as base64 or a data URL")
UNREADABLE = "not a readable regular file inside the server's media root"


class MediaPolicy:
    def __init__(self, limits: ServerLimits, root: str | os.PathLike | None = None):
        self.limits = limits
        self.root = None if root is None else Path(root).resolve()

    # ---- one reference ----------------------------------------------------------------------
    def data(self, ref) -> bytes:
        """The encoded bytes a reference names (ValueError, never an OSError)."""
        ref = _ref_string(ref)
        s = ref.strip()
        if s.startswith("data:"):
            header, sep, payload = s.partition(",")
            if not sep or not header.endswith(";base64"):
                raise ValueError("unsupported data URL (expected data:<mime>;base64,...)")
            return self._b64(payload)
        if s.startswith(("http://", "https://")):
            raise ValueError("remote image URLs are not fetched; send the image as base64 or a data URL")
        if s.startswith("file://"):
            return self._file(s[len("file://"):])
        compact = "".join(s.split())
        if compact and len(compact) % 4 == 0 and _BASE64.fullmatch(compact):
            return self._b64(compact)
        return self._file(s)

    def image(self, ref, budget: list[int] | None = None) -> Image.Image:
        """A decoded image; budget: [pixels left for this prompt], decremented."""
        lim = self.limits
        data = self.data(ref)
        try:  # reads the header only
            img = Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError:
            raise ValueError(f"the image has more pixels than the limit of {lim.max_image_pixels} "
                             f"({flag('max_image_pixels')})") from None
        except Exception:  # noqa: BLE001 - PIL raises UnidentifiedImageError, SyntaxError, struct.error...
            raise ValueError(f"not a decodable image ({', '.join(FORMATS)})") from None
        w, h = img.size
        if w * h > lim.max_image_pixels:
            raise ValueError(f"a {w}x{h} image is over the limit of {lim.max_image_pixels} pixels "
                             f"({flag('max_image_pixels')})")
        if budget is not None:
            if w * h > budget[0]:
                raise ValueError(f"the prompt's images and frames together are over the limit of "
                                 f"{lim.max_prompt_pixels} pixels ({flag('max_prompt_pixels')})")
            budget[0] -= w * h
        try:
            img.load()
        except Exception:  # noqa: BLE001 - PIL raises OSError, SyntaxError, struct.error... on corrupt data
            raise ValueError(f"not a decodable image ({', '.join(FORMATS)})") from None
        return img

    # ---- a prompt's media ---------------------------------------------------------------------
    def budget(self) -> list[int]:
        return [self.limits.max_prompt_pixels]

    def images(self, refs, budget: list[int] | None = None) -> list[Image.Image]:
        budget = budget if budget is not None else self.budget()
        out = []
        for k, ref in enumerate(refs or ()):
            try:
                out.append(self.image(ref, budget))
            except ValueError as e:
                raise ValueError(f"image {k}: {e}") from None
        return out

    def video(self, frames, budget: list[int]) -> list[Image.Image]:
        frames = [frames] if isinstance(frames, (str, dict)) else frames
        if not isinstance(frames, list):
            raise ValueError("a video is a list of frames (images)")
        if len(frames) > self.limits.max_video_frames:
            raise ValueError(f"{len(frames)} frames are over the limit of {self.limits.max_video_frames} "
                             f"({flag('max_video_frames')})")
        out = []
        for k, ref in enumerate(frames):
            try:
                out.append(self.image(ref, budget))
            except ValueError as e:
                raise ValueError(f"frame {k}: {e}") from None
        return out

    def prompt(self, images, videos, budget: list[int] | None = None) -> tuple[list, list]:
        budget = budget if budget is not None else self.budget()
        out_videos = []
        for k, v in enumerate(videos or ()):
            try:
                out_videos.append(self.video(v, budget))
            except ValueError as e:
                raise ValueError(f"video {k}: {e}") from None
        return self.images(images, budget), out_videos

    def chat(self, messages: list[dict] | None, budget: list[int] | None = None) -> list[dict] | None:
        """Messages with every media payload of their content items (`image`, `image_url`, `video`)
        decoded; items without a payload take theirs from the prompt's `images` / `videos`."""
        if messages is None:
            return None
        budget = budget if budget is not None else self.budget()
        out = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                items = []
                for k, item in enumerate(content):
                    item = dict(item)
                    try:
                        if item.get("image") is not None or item.get("image_url") is not None:
                            payload = item.pop("image") if item.get("image") is not None else item["image_url"]
                            item.pop("image_url", None)
                            item["image"] = self.image(payload, budget)
                        elif item.get("video") is not None:
                            item["video"] = self.video(item["video"], budget)
                    except ValueError as e:
                        raise ValueError(f"content item {k}: {e}") from None
                    items.append(item)
                m = {**m, "content": items}
            out.append(m)
        return out

    # ---- sources ------------------------------------------------------------------------------
    def _b64(self, payload: str) -> bytes:
        payload = "".join(payload.split())
        cap = self.limits.max_image_bytes
        if len(payload) // 4 * 3 > cap + 2:  # before decoding: base64 holds 3 bytes per 4 characters
            raise ValueError(f"the image is over the limit of {cap} bytes ({flag('max_image_bytes')})")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not valid base64") from None
        if len(data) > cap:
            raise ValueError(f"the image is over the limit of {cap} bytes ({flag('max_image_bytes')})")
        return data

    def _file(self, path: str) -> bytes:
        if self.root is None:
            raise ValueError(NO_ROOT)
        cap = self.limits.max_image_bytes
        too_big = False
        try:
            full = (self.root / path).resolve(strict=True)  # an absolute path replaces the root
            if not full.is_relative_to(self.root):
                raise PermissionError
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
            with open(fd, "rb") as f:  # closes fd
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise PermissionError
                too_big = st.st_size > cap
                data = b"" if too_big else f.read(cap + 1)  # the file may grow after fstat
                too_big = too_big or len(data) > cap
        except (OSError, RuntimeError, ValueError):  # missing, outside, not regular, unreadable, NUL in the path
            raise ValueError(UNREADABLE) from None
        if too_big:
            raise ValueError(f"the file is over the image limit of {cap} bytes ({flag('max_image_bytes')})")
        return data


def _ref_string(x) -> str:
    """A reference as a string: verl / OpenAI dict forms ({"url"}, {"image_url": {"url"}}, {"bytes"},
    {"path"}) are unwrapped."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return _image_ref(x)
    raise ValueError(f"an image is a base64 string, data URL or file reference, not {type(x).__name__}")
