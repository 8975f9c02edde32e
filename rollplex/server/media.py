"""Images and video frames a request names -> decoded PIL images, under the server's media policy.

    media = MediaPolicy(limits, root)        # root: --media-root, or None (no local files at all)
    media.prompt(images, videos)             # (images, videos) as PIL images, ValueError otherwise
    media.chat(messages)                     # messages whose content items carry PIL images

The server resolves every media reference of a request here, on an intake thread, and hands the
processor decoded images only, so the library's `load_image` (which reads any path it is given, for
trusted in-process callers) never sees a client's string.

A reference is a data URL, a base64 string, or a local file: `file://PATH` or any other string
that is not valid base64. Remote URLs are refused. Local files are read only when the server was
started with a media root, and then only regular files inside it, found without an oracle: the path
is judged from its text first (relative, or absolute under the root's own path; normalised: no `..`,
`.` or empty component), so a path that leaves the root is refused before the file system is touched
(`/etc/x/../..ROOT/a.png` answers as `/etc/nope/../..ROOT/a.png` does); then it is opened one
component at a time from the root's descriptor (openat-style, `dir_fd`) with O_NOFOLLOW, so no
symlink is followed and what was checked is what is read (no resolve-then-open race). Without a root
no path is looked up at all, and every failure to read a file (not normalised, outside the root, a
symlink, missing, not a regular file, unreadable) gets the one message, so an answer never tells a
client whether or how large a file is. A file's size is checked on the open descriptor and at most
max_image_bytes + 1 bytes are read (a FIFO or /dev/zero is refused before any read; opened
non-blocking so that a FIFO cannot hang the intake thread).

Decoding: PNG, JPEG (and MPO), WebP, GIF, BMP and TIFF only (PIL's EPS plugin, for one, would run
Ghostscript). The size from the header is checked against max_image_pixels, and charged to the
prompt's budget (max_prompt_pixels: its images and frames together) and to its request's
(max_request_pixels: every prompt's, shared across the intake threads decoding them) before the pixels
are decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import threading
from pathlib import Path

from PIL import Image

from .limits import ServerLimits, flag
from .schemas import _image_ref

# Pillow opens MPO files through the JPEG plugin and has no "MPO" opener: naming it raised KeyError,
# after PNG and JPEG were tried, for every other format
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_BASE64 = re.compile(r"[A-Za-z0-9+/]*={0,2}")
NO_ROOT = ("not a data URL or base64 image, and local files are not read by this server (it reads files only "
           "under a --media-root, which it was started without): send the image as base64 or a data URL")
UNREADABLE = "not a readable regular file inside the server's media root"


class RequestPixels:
    """Pixels left for one request: its prompts, decoded on several intake threads at once, draw on it."""

    def __init__(self, limit: int):
        self.limit, self.left = limit, limit
        self._lock = threading.Lock()

    def take(self, pixels: int) -> None:
        with self._lock:
            if pixels > self.left:
                raise ValueError(f"the request's images and frames together are over the limit of {self.limit} "
                                 f"pixels ({flag('max_request_pixels')}): split the request")
            self.left -= pixels


class PixelBudget:
    """Pixels left for one prompt's images and frames, and for its request's (RequestPixels, or None)."""

    def __init__(self, limit: int, request: RequestPixels | None = None):
        self.left, self.request = limit, request

    def take(self, pixels: int, limit: int) -> None:
        """Charge `pixels` (read from a header, before decoding); ValueError when over either budget."""
        if pixels > self.left:
            raise ValueError(f"the prompt's images and frames together are over the limit of {limit} pixels "
                             f"({flag('max_prompt_pixels')})")
        if self.request is not None:
            self.request.take(pixels)
        self.left -= pixels


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

    def image(self, ref, budget: PixelBudget | None = None) -> Image.Image:
        """A decoded image; its pixels are charged to `budget` before they are decoded."""
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
            budget.take(w * h, lim.max_prompt_pixels)
        try:
            img.load()
        except Exception:  # noqa: BLE001 - PIL raises OSError, SyntaxError, struct.error... on corrupt data
            raise ValueError(f"not a decodable image ({', '.join(FORMATS)})") from None
        return img

    # ---- a prompt's media ---------------------------------------------------------------------
    def request(self) -> RequestPixels:
        """The pixel budget of one request (--max-request-pixels), for every prompt's `budget`."""
        return RequestPixels(self.limits.max_request_pixels)

    def budget(self, request: RequestPixels | None = None) -> PixelBudget:
        """The pixel budget of one prompt (--max-prompt-pixels), drawing on its request's too when given."""
        return PixelBudget(self.limits.max_prompt_pixels, request)

    def images(self, refs, budget: PixelBudget | None = None) -> list[Image.Image]:
        budget = budget if budget is not None else self.budget()
        out = []
        for k, ref in enumerate(refs or ()):
            try:
                out.append(self.image(ref, budget))
            except ValueError as e:
                raise ValueError(f"image {k}: {e}") from None
        return out

    def video(self, frames, budget: PixelBudget) -> list[Image.Image]:
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

    def prompt(self, images, videos, budget: PixelBudget | None = None) -> tuple[list, list]:
        budget = budget if budget is not None else self.budget()
        out_videos = []
        for k, v in enumerate(videos or ()):
            try:
                out_videos.append(self.video(v, budget))
            except ValueError as e:
                raise ValueError(f"video {k}: {e}") from None
        return self.images(images, budget), out_videos

    def chat(self, messages: list[dict] | None, budget: PixelBudget | None = None) -> list[dict] | None:
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
        parts = _lexical_parts(path, self.root)  # before the file system is touched at all
        if parts is None:
            raise ValueError(UNREADABLE)
        cap = self.limits.max_image_bytes
        try:
            data = _read_beneath(self.root, parts, cap)
        except OSError:  # missing, a symlink, not a regular file, unreadable: one answer for all
            raise ValueError(UNREADABLE) from None
        if data is None:
            raise ValueError(f"the file is over the image limit of {cap} bytes ({flag('max_image_bytes')})")
        return data


def _lexical_parts(path: str, root: Path) -> list[str] | None:
    """The components of `path` under `root`, from its text alone; None unless it is a normalised path
    (no `..`, `.` or empty component, no NUL) that lies under the root: a relative path, or an absolute
    one that starts with the root's own (resolved) path."""
    if not path or "\0" in path:
        return None
    if path.startswith("/"):
        prefix = str(root).rstrip("/") + "/"
        if not path.startswith(prefix):
            return None
        path = path[len(prefix):]
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return None
    return parts


# O_NOFOLLOW on every component: a symlink anywhere under the root is refused, so what was checked (the
# lexical path) is what is opened, in one walk of descriptors (no resolve-then-open race)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE = (os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
         | getattr(os, "O_NOCTTY", 0))  # non-blocking: a FIFO cannot hang the intake thread


def _read_beneath(root: Path, parts: list[str], cap: int) -> bytes | None:
    """The bytes of the regular file root/parts..., opened openat-style from the root's descriptor one
    component at a time; None when it holds more than `cap` bytes. OSError for anything else."""
    fds = [os.open(root, _DIR)]
    try:
        for name in parts[:-1]:
            fds.append(os.open(name, _DIR, dir_fd=fds[-1]))
        fd = os.open(parts[-1], _FILE, dir_fd=fds[-1])
        with open(fd, "rb") as f:  # closes fd
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):  # a FIFO, device or folder: refused before any read
                raise PermissionError
            if st.st_size > cap:
                return None
            data = f.read(cap + 1)  # the file may grow after fstat
            return None if len(data) > cap else data
    finally:
        for d in fds:
            os.close(d)


def _ref_string(x) -> str:
    """A reference as a string: verl / OpenAI dict forms ({"url"}, {"image_url": {"url"}}, {"bytes"},
    {"path"}) are unwrapped."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return _image_ref(x)
    raise ValueError(f"an image is a base64 string, data URL or file reference, not {type(x).__name__}")
