"""Datasets in verl's row format, from parquet or jsonl, and rows -> model inputs.

A row: `prompt` (chat messages whose string content may hold `<image>` / `<video>` placeholders),
`images` (list of PIL images, paths, base64 / data URLs, or verl's `{"bytes": ..., "path": ...}`
dicts), optional `videos` (lists of frames), `data_source`, `reward_model.ground_truth`,
`extra_info`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image


def load_rows(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"dataset {path} does not exist")
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover
            raise ValueError("reading parquet needs pyarrow (pip install 'rollplex[data]')") from e
        return pq.read_table(path).to_pylist()
    raise ValueError(f"unsupported dataset format {path.suffix!r} (use .jsonl or .parquet)")


def save_rows(rows: list[dict], path: str | Path) -> Path:
    """Write rows; PIL images become verl's {"bytes": png} dicts (parquet) or data URLs (jsonl)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    as_url = path.suffix == ".jsonl"
    out = [{**r, "images": [_encode_image(im, as_url) for im in r.get("images") or []]} for r in rows]
    if path.suffix == ".jsonl":
        with open(path, "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(out), path)
    else:
        raise ValueError(f"unsupported dataset format {path.suffix!r}")
    return path


def _encode_image(im, as_url: bool):
    if not isinstance(im, Image.Image):
        return im
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    if as_url:
        import base64

        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"bytes": buf.getvalue(), "path": None}


def _decode_image(x):
    if isinstance(x, dict):
        if x.get("bytes") is not None:
            data = x["bytes"]
            if isinstance(data, str):  # base64 text (JSON has no bytes)
                import base64

                try:
                    data = base64.b64decode(data, validate=True)
                except ValueError as e:
                    raise ValueError(f"image bytes are neither bytes nor base64: {e}") from e
            try:
                return Image.open(io.BytesIO(data)).convert("RGB")
            except OSError as e:
                raise ValueError(f"cannot decode image bytes: {e}") from e
        if x.get("path"):
            return x["path"]
        if x.get("image") is not None:
            return x["image"]
    return x


def row_to_inputs(processor, row: dict):
    """ModelInputs for a verl row (ValueError on malformed rows)."""
    if "prompt" not in row:
        raise ValueError("row has no 'prompt'")
    messages = row["prompt"]
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    images = [_decode_image(x) for x in row.get("images") or []]
    videos = [[_decode_image(f) for f in v] for v in row.get("videos") or []]
    return processor.encode(messages=list(messages), images=images or None, videos=videos or None)


def ground_truth(row: dict):
    rm = row.get("reward_model") or {}
    return rm.get("ground_truth", row.get("ground_truth"))
