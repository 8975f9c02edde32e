"""Rollout backend selection: Rollplex's own engine (`native`) or SGLang (`sglang`, engine_patches/sglang).

SGLang is an optional dependency and is imported only when the SGLang backend is built:
`sglang_engine_class()` checks that it is installed and recent enough, then returns SGLang's Engine
subclassed with Rollplex's hooked scheduler. Every failure names the install command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

ROLLOUT_BACKENDS = ("native", "sglang")
INSTALL_HINT = "pip install 'rollplex[sglang]'"


@dataclass(frozen=True)
class BackendConfig:
    rollout_backend: str = "native"

    def __post_init__(self):
        check_backend(self.rollout_backend)


def check_backend(name: str) -> str:
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {name!r}")
    return name


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def require_sglang() -> str:
    """The installed SGLang's version; ImportError (with the install command) when it is missing or
    older than the oldest release the backend was checked against."""
    from engine_patches.sglang.contract import MIN_VERSION, NEWEST_CHECKED

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        raise ImportError(f"the sglang rollout backend needs SGLang (>= {MIN_VERSION}, checked up to "
                          f"{NEWEST_CHECKED}): {INSTALL_HINT}") from None
    if _release(version) < _release(MIN_VERSION):
        raise ImportError(f"SGLang {version} is older than {MIN_VERSION}, the oldest release the sglang rollout "
                          f"backend supports: {INSTALL_HINT}")
    return version


def sglang_engine_class() -> type:
    """SGLang's Engine with Rollplex's hooked scheduler (engine_patches.sglang.engine.RollplexEngine)."""
    version = require_sglang()
    from engine_patches.sglang.engine import load_engine_class

    try:
        return load_engine_class()
    except ImportError as e:
        raise ImportError(f"SGLang {version} is installed but its engine does not import ({e}); it needs its "
                          f"pinned torch and CUDA: {INSTALL_HINT}") from e
