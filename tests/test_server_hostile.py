"""A hostile client against the server (tiny model on CPU, one in-process server with small limits): nothing
a request names is run or read, request sizes are bounded with clear 413 / 400 answers, and a heavy prompt
does not hold up other clients.

Every hostile case checks the status, the message (clear; never a file's size or whether it exists), that
the server still generates, and that its state is unchanged: a float64 fingerprint of the policy read from
the server object, `weights_version`, `global_step` and the retained rollout. Unit tests cover the media
policy (paths under a media root), the reward registry and the limits' flags without a server.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import socket
import struct
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from server_helpers import IMG, png_b64, wire_rows

from rollplex.engine import EngineConfig
from rollplex.processor import VLProcessor
from rollplex.rl.config import RLConfig
from rollplex.server import ServerConfig, serve_in_thread
from rollplex.server.limits import ServerLimits
from rollplex.server.media import NO_ROOT, UNREADABLE, MediaPolicy
from rollplex.server.rewards import RewardRegistry
from rollplex.tiny import write_tiny

GREEDY = {"temperature": 0, "max_new_tokens": 2}
LIMITS = ServerLimits(max_body_bytes=4 << 20, max_prompts=8, max_prompt_chars=600_000, max_image_bytes=64 << 10,
                      max_image_pixels=200_000, max_prompt_pixels=300_000, max_video_frames=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny-hostile"), seed=0)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    cfg = ServerConfig(model=str(tiny_dir), device="cpu", limits=LIMITS,
                       rl=RLConfig(n=2, lr=1e-3, kl_coef=0.0, max_new_tokens=2),
                       engine=EngineConfig(max_model_len=256, kv_cache_tokens=8192, max_num_seqs=16),
                       checkpoint_root=str(tmp_path_factory.mktemp("ckpt-hostile")))
    srv = serve_in_thread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def retained(client) -> str:
    """A retained training rollout that every hostile case must leave trainable."""
    r = client.post("/rollout", json={"prompts": wire_rows(2), "n": 2})
    assert r.status_code == 200, r.text
    return r.json()["rollout_id"]


def snapshot(server, rollout_id: str) -> tuple:
    state = server.state
    with torch.no_grad():
        weights = sum(float(p.double().sum() + p.double().square().sum()) for p in state.model.parameters())
    return weights, state.weights_version, state.rl.step_idx, len(state.store), state.store.get(rollout_id)


def message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


def assert_intact(client, server, rollout_id: str, before: tuple) -> None:
    """The server still generates and nothing changed: weights, version, step, retained rollouts."""
    r = client.post("/generate", json={"text": "What color is the", "sampling_params": GREEDY})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] >= 1, r.text
    after = snapshot(server, rollout_id)
    assert after == before and after[-1] is not None


# ---- rewards: only those registered at startup ------------------------------------------------------------
def _marker_module(path: Path, marker: Path) -> Path:
    path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n\ndef fn(*args, **kwargs):\n    return 1.0\n")
    return path


def test_a_request_naming_code_runs_nothing(client, server, retained, tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    evil_file = _marker_module(tmp_path / "evil.py", marker)
    _marker_module(tmp_path / "evil_hostile_mod.py", marker)
    monkeypatch.syspath_prepend(str(tmp_path))  # importable, were the server to import what a request names
    before = snapshot(server, retained)
    for name in ("os:system", "subprocess:call", f"{evil_file}:fn", "evil_hostile_mod:fn", "../evil.py:fn",
                 "no_such_reward"):
        r = client.post("/train_step", json={"rollout_id": retained, "reward": name})
        assert r.status_code == 400, (name, r.text)
        msg = message(r)
        assert f"unknown reward {name!r}" in msg and "registered at startup" in msg and "shape_color" in msg, msg
        assert ("--reward-module" in msg) == (":" in name), msg
    assert not marker.exists() and "evil_hostile_mod" not in sys.modules
    assert_intact(client, server, retained, before)


def test_reward_registry(tmp_path, caplog):
    op_marker, client_marker = tmp_path / "op", tmp_path / "client"
    op_file = _marker_module(tmp_path / "op_reward.py", op_marker)
    client_file = _marker_module(tmp_path / "client_reward.py", client_marker)
    reg = RewardRegistry("choice", (f"mine={op_file}:fn",))
    assert op_marker.exists()  # the operator's code is imported at startup
    assert reg.get("mine")(None, "x", "y") == 1.0 and reg.get(f"{op_file}:fn") is reg.get("mine")
    assert reg.default is reg.get("choice")
    with pytest.raises(ValueError, match="--reward-module"):
        reg.get(f"{client_file}:fn")
    assert not client_marker.exists()
    with pytest.raises(ValueError, match="unknown reward 'bogus'"):
        RewardRegistry("bogus")
    with pytest.raises(ValueError, match="cannot load"):
        RewardRegistry("default", ("rollplex.nope:fn",))
    with caplog.at_level(logging.WARNING, logger="rollplex.server"):
        opened = RewardRegistry(allow_client_code=True)
    assert any("--allow-client-reward-code" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert opened.get(f"{client_file}:fn")(None, "x", "y") == 1.0 and client_marker.exists()


# ---- media: no local file is read without a media root ------------------------------------------------------
def _png_bytes(size=(56, 56), color=(220, 40, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def test_local_media_paths_are_refused_without_reading(client, server, retained, tmp_path):
    real = tmp_path / "real.png"
    real.write_bytes(_png_bytes())
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)  # opened for reading, it would block the intake thread until a writer came
    refs = [str(real), f"file://{real}", str(tmp_path / "missing.png"), str(fifo), "/etc/passwd",
            "file:///etc/passwd", "file:///dev/zero", "../../etc/passwd", "/dev/zero", "not an image!!"]
    before = snapshot(server, retained)
    messages = set()
    for ref in refs:
        r = client.post("/generate", json={"text": f"{IMG}What color?", "image_data": ref, "sampling_params": GREEDY})
        assert r.status_code == 400, (ref, r.text)
        messages.add(message(r))
    # one answer for an existing file, a missing one, a FIFO, a device: nothing tells them apart
    assert messages == {f"prompt[0]: image 0: {NO_ROOT}"}, messages
    assert str(real.stat().st_size) not in next(iter(messages))
    row = wire_rows(1)[0]
    rollouts = [{**row, "images": [str(real)]}, {**row, "images": [{"path": str(real)}]},
                {**row, "images": [{"url": f"file://{real}"}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "image": str(real)},
                                                           {"type": "text", "text": "Color?"}]}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}},
                                                           {"type": "text", "text": "Color?"}]}]},
                {"messages": [{"role": "user", "content": [{"type": "image", "image": ""},
                                                           {"type": "text", "text": "Color?"}]}]},
                {"messages": [{"role": "user", "content": "<video>What moves?"}], "videos": [[str(real)]]}]
    for prompt in rollouts:
        r = client.post("/rollout", json={"prompts": [prompt], "n": 2})
        assert r.status_code == 400 and NO_ROOT in message(r), (prompt, r.text)
    assert_intact(client, server, retained, before)


def test_media_root_confines_paths(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    png = _png_bytes()
    (root / "a.png").write_bytes(png)
    (root / "sub" / "b.png").write_bytes(png)
    (outside / "secret.png").write_bytes(png)
    (root / "in.png").symlink_to(root / "a.png")
    (root / "out.png").symlink_to(outside / "secret.png")
    (root / "big.png").write_bytes(png + b"\0" * 4096)
    os.mkfifo(root / "fifo.png")
    policy = MediaPolicy(ServerLimits(max_image_bytes=len(png) + 100), root)
    for ok in ("a.png", f"file://{root}/a.png", str(root / "sub" / "b.png"),
               base64.b64encode(png).decode(), "data:image/png;base64," + base64.b64encode(png).decode()):
        assert policy.image(ok).size == (56, 56), ok
    refused = {}
    for bad in ("sub/../a.png", "in.png",  # not normalised; a symlink (even one that stays inside)
                "../outside/secret.png", str(outside / "secret.png"), f"file://{outside}/secret.png", "out.png",
                "missing.png", "sub", "fifo.png", "/dev/zero", "file:///dev/zero", "/etc/passwd", "a.png\0x",
                "/proc/self/environ"):
        with pytest.raises(ValueError) as e:
            policy.data(bad)
        refused[bad] = str(e.value)
    assert set(refused.values()) == {UNREADABLE}, refused  # one message: no existence or size leaks out
    with pytest.raises(ValueError, match="over the image limit"):
        policy.data("big.png")
    with pytest.raises(ValueError, match="remote"):
        policy.data("https://example.com/a.png")
    with pytest.raises(ValueError, match=NO_ROOT[:30]):
        MediaPolicy(ServerLimits()).data(str(root / "a.png"))  # no root: not even a file inside the root


def test_a_media_root_serves_files_under_it(client, server, retained, tmp_path, monkeypatch):
    (tmp_path / "a.png").write_bytes(_png_bytes())
    monkeypatch.setattr(server.state, "media", MediaPolicy(LIMITS, tmp_path))
    body = {"text": f"{IMG}What color?", "sampling_params": GREEDY}
    by_path = client.post("/generate", json={**body, "image_data": "a.png"})
    assert by_path.status_code == 200, by_path.text
    sent = client.post("/generate", json={**body, "image_data": png_b64()}).json()
    assert by_path.json()["output_ids"] == sent["output_ids"] and by_path.json()["meta_info"]["prompt_tokens"] == \
        sent["meta_info"]["prompt_tokens"]
    before = snapshot(server, retained)
    for bad in ("../a.png", "missing.png", "/etc/passwd"):
        r = client.post("/generate", json={**body, "image_data": bad})
        assert r.status_code == 400 and message(r) == f"prompt[0]: image 0: {UNREADABLE}", r.text
    assert_intact(client, server, retained, before)


# ---- limits -------------------------------------------------------------------------------------------------
def _raw_post(url: str, head: bytes, chunks=()) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        try:
            for c in chunks:
                s.sendall(c)
        except OSError:  # the server answered and closed before the rest arrived
            pass
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            got = s.recv(65536)
            if not got:
                break
            data += got
        return data


def test_request_body_over_the_limit_is_413(client, server, retained):
    before = snapshot(server, retained)
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    t0 = time.perf_counter()
    answer = _raw_post(server.url, head % 10**12)  # announced, never sent: answered at once
    assert answer.startswith(b"HTTP/1.1 413") and b"--max-body-bytes" in answer, answer[:300]
    assert time.perf_counter() - t0 < 30
    chunk = b'{"text": "' + b"x" * (1 << 20)
    chunked = (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    body = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 6 + [b"0\r\n\r\n"]  # 6 MiB streamed, no length announced
    answer = _raw_post(server.url, chunked, body)
    assert answer.startswith(b"HTTP/1.1 413") and b"4194304 bytes" in answer, answer[:300]
    assert_intact(client, server, retained, before)


def test_prompt_counts_and_sizes(client, server, retained):
    before = snapshot(server, retained)
    cases = [
        ("/generate", {"text": ["hi"] * 9}, "9 prompts in one request; this server takes at most 8 (--max-prompts)"),
        ("/generate", {"input_ids": [[5, 6]] * 9}, "--max-prompts"),
        ("/rollout", {"prompts": wire_rows(1) * 9, "n": 2}, "--max-prompts"),
        ("/generate", {"text": "x" * 600_001}, "600001 characters of prompt text exceed the limit of 600000"),
        ("/generate", {"text": ["hi", "y " * 400_000]}, "prompt[1]: 800000 characters"),
        ("/rollout", {"prompts": [{"messages": [{"role": "user", "content": [
            {"type": "text", "text": "z" * 1_000_000}, {"type": "text", "text": "z" * 1_000_000}]}]}]},
         "prompts[0]: 2000012 characters"),  # the role and the items' types count too
        ("/generate", {"input_ids": list(range(5, 100_005))}, "100000 prompt token ids exceed max_model_len=256"),
        ("/rollout", {"prompts": [{"input_ids": [5] * 300}]}, "prompts[0]: 300 prompt token ids"),
    ]
    for route, body, expected in cases:
        r = client.post(route, json=body)
        assert r.status_code == 400 and expected in message(r), (route, r.text[:300])
    assert_intact(client, server, retained, before)


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (a decompression bomb's shape), with one empty IDAT."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_image_limits(client, server, retained):
    noise = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8)).save(noise, "PNG")
    assert len(noise.getvalue()) > LIMITS.max_image_bytes
    b64 = lambda data: base64.b64encode(data).decode()  # noqa: E731
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    body = {"text": f"{IMG}What color?", "sampling_params": GREEDY}
    before = snapshot(server, retained)
    cases = [
        ({**body, "image_data": b64(noise.getvalue())}, "over the limit of 65536 bytes (--max-image-bytes)"),
        ({**body, "image_data": b64(_png_bytes((1000, 1000)))}, "1000x1000 image is over the limit of 200000 pixels"),
        ({**body, "image_data": b64(_png_header_only(100_000, 100_000))}, "--max-image-pixels"),
        ({**body, "image_data": b64(eps)}, "not a decodable image"),  # PIL's EPS plugin would run Ghostscript
        ({**body, "text": f"{IMG}{IMG}Colors?", "image_data": [b64(_png_bytes((400, 400)))] * 2},
         "--max-prompt-pixels"),
    ]
    for req, expected in cases:
        r = client.post("/generate", json=req)
        assert r.status_code == 400 and expected in message(r), (expected, r.text[:300])
    frame = "data:image/png;base64," + png_b64()
    video = {"messages": [{"role": "user", "content": "<video>What moves?"}], "videos": [[frame] * 5]}
    r = client.post("/rollout", json={"prompts": [video], "n": 2})
    assert r.status_code == 400 and "5 frames are over the limit of 4 (--max-video-frames)" in message(r), r.text
    assert_intact(client, server, retained, before)


def test_a_heavy_prompt_does_not_hold_up_other_clients(client, server, retained, monkeypatch):
    """A prompt just under the character limit takes a while to tokenise: other clients' requests are prepared on
    the other intake threads meanwhile and answer as fast as without it; one over the limit is refused before
    any tokenising."""
    small = {"text": "What color is the", "sampling_params": GREEDY}

    def timed(body) -> tuple[float, httpx.Response]:
        t0 = time.perf_counter()
        r = client.post("/generate", json=body) if body is small else httpx.post(server.url + "/generate", json=body,
                                                                                  timeout=120)
        return time.perf_counter() - t0, r

    baseline = sorted(timed(small)[0] for _ in range(5))[2]
    encode, started, finished = VLProcessor.encode, threading.Event(), threading.Event()

    def observed(self, text=None, **kw):  # the real encode; only records when the heavy one runs
        heavy = text is not None and len(text) > 100_000
        started.set() if heavy else None
        try:
            return encode(self, text=text, **kw)
        finally:
            finished.set() if heavy else None

    monkeypatch.setattr(VLProcessor, "encode", observed)
    before = snapshot(server, retained)
    heavy = {}
    text = "the quick brown fox jumps " * (LIMITS.max_prompt_chars // 26)
    t = threading.Thread(target=lambda: heavy.update(zip(("s", "r"), timed({"text": text}))))
    t.start()
    assert started.wait(60)
    during, r = timed(small)
    heavy_running = not finished.is_set()
    t.join(120)
    assert r.status_code == 200 and heavy["r"].status_code == 400 and "max_model_len" in message(heavy["r"])
    assert heavy_running, "the small request was answered only after the heavy prompt was tokenised"
    assert during < max(10 * baseline, heavy["s"] / 4), (during, baseline, heavy["s"])
    over_s, over = timed({"text": text + "x" * LIMITS.max_prompt_chars})
    assert over.status_code == 400 and "--max-prompt-chars" in message(over)
    assert over_s < heavy["s"] / 2, (over_s, heavy["s"])  # refused before tokenising
    assert_intact(client, server, retained, before)


# ---- configuration ------------------------------------------------------------------------------------------
def test_limits_and_policy_flags(tmp_path):
    from rollplex.server.__main__ import config_from_args, parser

    args = parser().parse_args(["--max-prompts", "5", "--max-prompt-chars", "100", "--reward-module", "a=m:f",
                                "--reward-module", "n:g", "--media-root", str(tmp_path), "--intake-threads", "2"])
    cfg = config_from_args(args)
    assert cfg.limits == ServerLimits(max_prompts=5, max_prompt_chars=100)
    assert cfg.reward_modules == ("a=m:f", "n:g") and not cfg.allow_client_reward_code
    assert cfg.media_root == str(tmp_path.resolve()) and cfg.intake_threads == 2
    default = config_from_args(parser().parse_args([]))
    assert default.media_root is None and default.limits == ServerLimits() and not default.allow_client_reward_code
    assert default.limits.prompt_chars(4096) == 32 * 4096
    with pytest.raises(ValueError, match="max_prompts"):
        ServerLimits(max_prompts=0)
    with pytest.raises(ValueError, match="media_root"):
        ServerConfig(media_root=str(tmp_path / "nope"))
