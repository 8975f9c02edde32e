"""Decode-kernel tuning results on disk: a restart on the same GPU and software skips the timing.

    cache = TuningCache(resolve_dir(setting))     # setting: EngineConfig.tuning_cache_dir
    value = cache.get(key)                        # None: not there, or unreadable (warned; tune again)
    cache.put(key, value)                         # one JSON file per key, written atomically

A key is a JSON-able dict of everything a result depends on: `environment()` (GPU name and compute
capability, torch / CUDA / triton versions, a digest of this package's kernel sources, the file
format) plus the shapes and the candidate list that were timed. The file is named by the key's
SHA-256 and holds the key next to the value, so a file that does not answer its key exactly (a hand
edit, a truncated write from elsewhere) is treated like a corrupt one: ignored with a warning, and
the result is timed again and rewritten. Files are written to a temporary name and renamed into
place, so servers sharing the directory never read a half-written file.

Where: `resolve_dir("auto")` is $ROLLPLEX_CACHE_DIR/tuning when that variable is set, else
~/.cache/rollplex/tuning; None or "" turn the cache off (nothing is read or written); anything else
is the directory itself.

Also here: the JSON form of the two tuned results, an attention launch config (num_splits, tile)
and `SkinnyGemms` (with the tuner's timings).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("rollplex.engine")

AUTO = "auto"
FORMAT = 1  # bump when the stored form of a result changes


def resolve_dir(setting: str | None) -> Path | None:
    """The cache directory for an EngineConfig.tuning_cache_dir value (None: off)."""
    if not setting:
        return None
    if setting == AUTO:
        root = os.environ.get("ROLLPLEX_CACHE_DIR")
        return (Path(root).expanduser() if root else Path.home() / ".cache" / "rollplex") / "tuning"
    return Path(setting).expanduser()


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class TuningCache:
    def __init__(self, directory: str | os.PathLike | None):
        self.directory = Path(directory) if directory else None

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def path(self, key: dict) -> Path:
        assert self.directory is not None, "the cache is off"
        return self.directory / f"{key.get('what', 'tuning')}-{key_digest(key)[:32]}.json"

    def get(self, key: dict) -> Any:
        """The value stored under `key`, or None (not stored, unreadable, or stored for another key)."""
        if self.directory is None:
            return None
        path = self.path(key)
        try:
            with open(path) as f:
                entry = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("tuning cache: ignoring unreadable %s (%s); tuning again", path, e)
            return None
        if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key)) or "value" not in entry:
            log.warning("tuning cache: ignoring %s (it does not hold this key's result); tuning again", path)
            return None
        return entry["value"]

    def put(self, key: dict, value: Any) -> bool:
        """Store `value` under `key` (atomically); False, with a warning, if it could not be written."""
        if self.directory is None:
            return False
        path = self.path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"key": key, "value": value}, f, sort_keys=True, indent=1)
            os.replace(tmp, path)
            return True
        except (OSError, TypeError, ValueError) as e:
            log.warning("tuning cache: could not write %s (%s)", path, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False


@functools.cache
def kernels_digest() -> str:
    """SHA-256 of this package's sources: a kernel or tuner change invalidates what was timed before."""
    h = hashlib.sha256()
    for src in sorted(Path(__file__).parent.glob("*.py")):
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def environment(device) -> dict:
    """The key parts naming the GPU and the software a tuning result was timed with."""
    import torch

    from .paged_attention_triton import triton_available

    triton_version = None
    if triton_available():
        import triton

        triton_version = triton.__version__
    return {"format": FORMAT, "gpu": torch.cuda.get_device_name(device),
            "capability": list(torch.cuda.get_device_capability(device)), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton_version, "kernels": kernels_digest()}


# ---- stored forms ----------------------------------------------------------------------------------
def attention_to_json(cfg: tuple) -> list:
    return [cfg[0], cfg[1]]


def attention_from_json(value) -> tuple:
    num_splits, tile = value
    if not (num_splits is None or isinstance(num_splits, int)) or not (tile is None or isinstance(tile, dict)):
        raise ValueError(f"not an attention launch config: {value!r}")
    return num_splits, tile


def gemms_to_json(gemms, times: dict) -> dict:
    """SkinnyGemms + the tuner's timings; the fused SwiGLU kernel is stored as its launch config."""
    from .swiglu_gemm import swiglu_linear

    fused = gemms.gate_up_swiglu
    if fused is not None and not (isinstance(fused, functools.partial) and fused.func is swiglu_linear):
        raise ValueError(f"cannot store the SwiGLU kernel {fused!r}: only swiglu_linear with a config")
    config = None if fused is None else fused.keywords["config"]
    return {"o_splits": gemms.o_splits, "down_splits": gemms.down_splits,
            "swiglu_config": None if config is None else list(config),
            "times": {name: {str(k): v for k, v in t.items()} for name, t in times.items()}}


def gemms_from_json(value: dict) -> tuple:
    """(SkinnyGemms, timings) from `gemms_to_json`'s form; ValueError if it is not that form."""
    from .decode_gemms import SkinnyGemms
    from .swiglu_gemm import check_config, swiglu_linear

    config = value["swiglu_config"]
    fused = None
    if config is not None:
        config = tuple(config)
        check_config(config)
        fused = functools.partial(swiglu_linear, config=config)
    times = {name: {int(k) if name in ("o", "down") else k: v for k, v in t.items()}
             for name, t in value["times"].items()}
    return SkinnyGemms(int(value["o_splits"]), int(value["down_splits"]), fused), times
