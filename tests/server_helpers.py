"""Helpers for the HTTP tests: a real uvicorn server in a thread, images as base64, rows on the wire."""

from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import time

from PIL import Image

from rollplex.tiny import shape_color

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def png_b64(color=(220, 40, 40), size=(56, 56)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def wire_rows(n: int, seed: int = 0) -> list[dict]:
    """shape-colour verl rows with their images as data URLs (what a client sends)."""
    out = []
    for r in shape_color.make_rows(n, seed=seed):
        buf = io.BytesIO()
        r["images"][0].save(buf, format="PNG")
        out.append({"prompt": r["prompt"], "data_source": r["data_source"], "reward_model": r["reward_model"],
                    "images": ["data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()]})
    return out


def sse_events(lines) -> list:
    """Parse `data: ...` lines of an SSE stream; [DONE] becomes the string "[DONE]"."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll GET /health until it answers 200; fail with the process's output if it exits or times out."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode()[-4000:] if proc.stdout else "the server exited"
        assert time.monotonic() < deadline, f"the server at {url} did not come up in {timeout:.0f} s"
        time.sleep(0.2)
