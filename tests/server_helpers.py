"""Helpers for the HTTP tests: a real uvicorn server in a thread, images as base64, rows on the wire."""

from __future__ import annotations

import base64
import io
import json

from PIL import Image

from rollplex.demo import shape_color

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
