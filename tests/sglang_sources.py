"""The `sglang_source` fixture: one checked SGLang release's source, read and never imported.

A session fixture downloads each checked release's wheel (`pip download --no-deps`, kept in pytest's
cache across runs) and extracts the files the contract names. The download needs PyPI: without it the
tests fail, unless ROLLPLEX_OFFLINE=1 (then they skip). Test modules import the fixture by name.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

from engine_patches.sglang import check
from engine_patches.sglang.check import FetchError, extract_sources, fetch_wheel
from engine_patches.sglang.contract import CHECKED_VERSIONS


def _cache_dir(config, tmp_path_factory) -> Path:
    if getattr(config, "cache", None) is not None:  # .pytest_cache/d/sglang-wheels, kept across runs
        return Path(config.cache.mkdir("sglang-wheels"))
    return tmp_path_factory.mktemp("sglang-wheels")


@pytest.fixture(scope="session", params=CHECKED_VERSIONS)
def sglang_source(request, tmp_path_factory):
    """(version, root of the extracted source files) of one checked SGLang release."""
    version = request.param
    cache = _cache_dir(request.config, tmp_path_factory)
    # test processes running side by side (pytest -n) share the cache: one downloads and extracts at a time
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _source(version, cache)


def _source(version: str, cache: Path) -> tuple[str, Path]:
    wheel = check.cached_wheel(version, cache)
    if wheel is None:
        if os.environ.get("ROLLPLEX_OFFLINE") == "1":
            pytest.skip(f"ROLLPLEX_OFFLINE=1 and no cached sglang {version} wheel in {cache}")
        error = None
        try:
            wheel = fetch_wheel(version, cache)
        except (FetchError, subprocess.TimeoutExpired) as e:
            error = str(e)
        if error is not None:
            pytest.fail(f"could not download SGLang {version} for its contract check: {error}\n"
                        "The contract tests need PyPI; set ROLLPLEX_OFFLINE=1 to skip them on a machine without it.",
                        pytrace=False)
    return version, extract_sources(wheel, cache)
