"""Model names to local checkpoint directories: a directory as given, or a Hugging Face model id
(`Qwen/Qwen2.5-VL-3B-Instruct`) resolved from the local Hugging Face cache, offline (nothing is
downloaded: `huggingface-cli download ID` fills the cache)."""

from __future__ import annotations

from pathlib import Path


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def resolve_model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory for `name`; ValueError when it is neither a directory nor a cached hub id."""
    if Path(name).is_dir():
        return Path(name)
    if not looks_like_hub_id(name):
        raise ValueError(f"{name!r} is not a directory or a Hugging Face model id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True, cache_dir=cache_dir))
    except LocalEntryNotFoundError:
        raise ValueError(f"{name} is not in the local Hugging Face cache (no downloads are made here): run "
                         f"`huggingface-cli download {name}` first, or pass a checkpoint directory") from None
