"""Media a request names: every format the docs list decodes, a media root confines paths without an
existence oracle (judged from the text before the file system is touched, then opened openat-style with
O_NOFOLLOW), and a request's images are charged to one pixel budget from their headers before decoding.

Unit tests run the real MediaPolicy on files under a temporary root; the HTTP tests run one in-process
server (the tiny model, CPU) whose answers must be the same as for the same image sent as PNG.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import httpx
import pytest
from PIL import Image
from server_helpers import IMG, wire_rows

from rollplex.engine import EngineConfig
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.server.limits import ServerLimits
from rollplex.server.media import UNREADABLE, MediaPolicy
from rollplex.tiny import write_tiny

FORMATS = ("WEBP", "GIF", "BMP", "TIFF")  # beside PNG and JPEG, which always decoded
GREEDY = {"temperature": 0, "max_new_tokens": 2}


def _encoded(fmt: str, size=(56, 56), color=(220, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_documented_format_decodes(fmt):
    policy = MediaPolicy(ServerLimits())
    img = policy.image("data:image/x;base64," + base64.b64encode(_encoded(fmt)).decode())
    assert img.size == (56, 56) and img.format == fmt
    r, g, b = img.convert("RGB").getpixel((28, 28))
    assert abs(r - 220) < 8 and abs(g - 40) < 8 and abs(b - 40) < 8, (fmt, (r, g, b))  # JPEG / WebP are lossy


# ---- the media root -----------------------------------------------------------------------------------
@pytest.fixture
def media(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    png = _encoded("PNG")
    (root / "ok.png").write_bytes(png)
    (root / "sub" / "b.png").write_bytes(png)
    return root, MediaPolicy(ServerLimits(), root)


def test_paths_that_leave_the_root_are_refused_before_the_file_system_is_touched(media, monkeypatch):
    """`/etc/passwd/../..ROOT/ok.png` used to be read (and `/etc/NOPE/../..ROOT/ok.png` refused): the
    walk before `..` collapsed told which host paths exist. Now no such path reaches the file system."""
    root, policy = media
    bad = [f"/etc/passwd/../..{root}/ok.png", f"/etc/NOPE/../..{root}/ok.png", f"file:///etc/passwd/../..{root}/ok.png",
           "/proc/1/environ", "/proc/self/environ", "../media/ok.png", "sub/../ok.png", "./ok.png", "sub//b.png",
           "sub/./b.png", "sub/", f"{root}/../media/ok.png", f"{root}", f"{root}/", f"{root}x/ok.png", "ok.png\0.x"]

    def touched(*a, **k):
        raise AssertionError(f"the file system was touched for a path refused by its text: {a}")

    answers = {}
    with monkeypatch.context() as m:
        for name in ("open", "stat", "lstat", "readlink", "listdir", "scandir"):
            m.setattr(os, name, touched)
        m.setattr(Path, "resolve", touched)
        for ref in bad:
            try:
                policy.data(ref)
            except (ValueError, AssertionError) as e:
                answers[ref] = str(e)
    assert set(answers.values()) == {UNREADABLE}, answers


def test_files_are_opened_beneath_the_root_without_following_symlinks(media, monkeypatch, tmp_path):
    root, policy = media
    outside = tmp_path / "secret.png"
    outside.write_bytes(_encoded("PNG", color=(0, 0, 255)))
    (root / "in.png").symlink_to(root / "ok.png")  # a symlink that stays inside is refused too: O_NOFOLLOW
    (root / "out.png").symlink_to(outside)
    (root / "linkdir").symlink_to(root / "sub")  # a symlinked folder on the way
    (root / "escape").symlink_to(tmp_path)
    for ref in ("in.png", "out.png", "linkdir/b.png", "escape/secret.png", "sub", "missing.png", "sub/missing.png"):
        with pytest.raises(ValueError) as e:
            policy.data(ref)
        assert str(e.value) == UNREADABLE, ref

    calls = []
    real_open = os.open

    def spy(path, flags, *a, **k):
        calls.append((os.fspath(path), flags, k.get("dir_fd")))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    assert policy.data("sub/b.png") == policy.data(f"file://{root}/sub/b.png") == _encoded("PNG")
    # the root by its path, then one component at a time from its parent's descriptor, never following a link
    first = calls[:3]
    assert [c[0] for c in first] == [str(root), "sub", "b.png"], calls
    assert first[0][2] is None and all(c[2] is not None for c in first[1:]), calls
    assert all(c[1] & os.O_NOFOLLOW for c in first), calls


def test_a_symlink_swapped_in_after_the_check_is_not_followed(media, tmp_path, monkeypatch):
    """The race of resolve-then-open: the path is replaced by a symlink to a file outside between the
    check and the open. Opened with O_NOFOLLOW from the root's descriptor, the swap is refused."""
    root, policy = media
    secret = tmp_path / "secret.png"
    secret.write_bytes(_encoded("PNG", color=(0, 0, 255)))
    target = root / "sub" / "b.png"
    real_open = os.open

    def swap_then_open(path, flags, *a, **k):
        if os.fspath(path) == "b.png" or os.fspath(path).endswith("/sub/b.png"):  # the file itself is next
            if not target.is_symlink():
                target.unlink()
                target.symlink_to(secret)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", swap_then_open)
    with pytest.raises(ValueError) as e:
        policy.data("sub/b.png")
    assert str(e.value) == UNREADABLE


# ---- pixel budget per request -------------------------------------------------------------------------
def test_a_requests_images_share_one_pixel_budget_charged_before_decoding(monkeypatch):
    limits = ServerLimits(max_prompt_pixels=10_000, max_request_pixels=5_000)
    policy = MediaPolicy(limits)
    ref = base64.b64encode(_encoded("PNG", size=(50, 50))).decode()  # 2500 pixels
    decoded = []
    real = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self.size) or real(self))
    request = policy.request()
    policy.images([ref], policy.budget(request))
    policy.images([ref], policy.budget(request))  # another prompt of the same request
    n = len(decoded)
    with pytest.raises(ValueError, match="the request's images and frames together are over the limit of 5000 "
                                         r"pixels \(--max-request-pixels\)"):
        policy.images([ref], policy.budget(request))
    assert len(decoded) == n  # refused from the header: not decoded
    policy.images([ref], policy.budget(policy.request()))  # another request has its own budget
    with pytest.raises(ValueError, match="must be >= 1"):
        ServerLimits(max_request_pixels=0)


# ---- over HTTP -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = write_tiny(tmp_path_factory.mktemp("tiny-media"), seed=0)
    cfg = ServerConfig(model=str(tiny), device="cpu", rl=RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=2),
                       limits=ServerLimits(max_request_pixels=8000),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt-media")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_formats_over_http_answer_as_png_does(client):
    def ask(fmt):
        data = base64.b64encode(_encoded(fmt)).decode()
        return client.post("/generate", json={"text": f"{IMG}What color?", "image_data": data,
                                              "sampling_params": GREEDY})

    png = ask("PNG")
    assert png.status_code == 200, png.text
    for fmt in ("GIF", "BMP", "TIFF"):  # lossless: the same pixels, the same answer
        r = ask(fmt)
        assert r.status_code == 200 and r.json()["output_ids"] == png.json()["output_ids"], (fmt, r.text)
    for fmt in ("WEBP", "JPEG"):
        r = ask(fmt)
        assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == png.json()["meta_info"][
            "prompt_tokens"], (fmt, r.text)


def test_the_request_pixel_budget_over_http(client):
    rows = wire_rows(3)  # 56x56 images: 3136 pixels each, 9408 together, over the budget of 8000
    r = client.post("/rollout", json={"prompts": rows, "n": 2})
    assert r.status_code == 400 and "--max-request-pixels" in r.json()["error"]["message"], r.text
    assert client.post("/rollout", json={"prompts": rows[:2], "n": 2}).status_code == 200
    img = rows[0]["images"][0]
    r = client.post("/generate", json={"text": [f"{IMG}Color?"] * 3, "image_data": [img] * 3,
                                       "sampling_params": GREEDY})
    assert r.status_code == 400 and "--max-request-pixels" in r.json()["error"]["message"], r.text
    r = client.post("/generate", json={"text": [f"{IMG}Color?"] * 2, "image_data": [img] * 2,
                                       "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
