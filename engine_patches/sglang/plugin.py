"""SGLang as a rollout backend plugin: what `rollplex.backends` finds under the name "sglang".

Rollplex never imports engine_patches (this package imports Rollplex): `rollplex.backends.PLUGINS` names
this module, and it is imported only when the SGLang backend is checked or built. A plugin module defines

    require(pythonpath)  the installed SGLang's version (here, or under `pythonpath` where SGLang runs in its
                    own process); ImportError (with the install command) when it is missing or older than the
                    oldest release the backend was checked against
    check_args(a)   ValueError when the further SGLang server arguments `a` set one the backend sets itself
    rollout(...)    SGLang's engine started on a checkpoint, as the RL step's RolloutBackend (SGLangRollout)

and, for direct use, `engine_class()`: SGLang's Engine with Rollplex's hooked scheduler; for the step
benchmark's co-scheduled rows, `cosched_hook(...)` (the co-scheduler's HookSpec) and `received_rows(...)`.
SGLang itself is imported only by `engine_class()` (engine.load_engine_class). With `sglang_pythonpath`
set, SGLang is never imported here: it runs in a process of its own with that PYTHONPATH first
(remote.RemoteEngine).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from importlib import metadata

from .backend import SGLangRollout
from .contract import MANAGED_SERVER_ARGS, MIN_VERSION, NEWEST_CHECKED, release_tuple
from .engine import load_engine_class

INSTALL_HINT = "pip install 'rollplex[sglang]'"


def require(pythonpath: str | None = None) -> str:
    """The installed SGLang's version (with `pythonpath`: the one a process with that PYTHONPATH first sees);
    ImportError (with the install command) when it is missing or older than the oldest release the backend
    was checked against."""
    missing = (f"the sglang rollout backend needs SGLang (>= {MIN_VERSION}, checked up to {NEWEST_CHECKED}): "
               f"{INSTALL_HINT}")
    if pythonpath is not None:
        version = _version_under(pythonpath)
        if version is None:
            raise ImportError(f"{missing} (none found under sglang_pythonpath {pythonpath!r})")
    else:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            raise ImportError(missing) from None
    if release_tuple(version) < release_tuple(MIN_VERSION):
        raise ImportError(f"SGLang {version} is older than {MIN_VERSION}, the oldest release the sglang rollout "
                          f"backend supports: {INSTALL_HINT}")
    return version


def _version_under(pythonpath: str) -> str | None:
    """SGLang's version as a Python process with `pythonpath` first on its path sees it (None: not there)."""
    if not os.path.isdir(pythonpath):
        return None
    from .remote import child_env

    code = "from importlib.metadata import version; print(version('sglang'))"
    res = subprocess.run([sys.executable, "-c", code], env=child_env(pythonpath), capture_output=True, text=True,
                         timeout=120)
    return res.stdout.strip() or None if res.returncode == 0 else None


def check_args(args: dict) -> None:
    """ValueError when the further server arguments set one that `rollout` sets itself."""
    managed = sorted(set(args) & set(MANAGED_SERVER_ARGS))
    if managed:
        raise ValueError(f"sglang_args cannot set {managed}: the backend sets them (model and dtype from the "
                         "policy, mem_fraction_static and the weight backup from their own settings)")


def engine_class() -> type:
    """SGLang's Engine with Rollplex's hooked scheduler (engine.RollplexEngine). ImportError naming the
    install command when SGLang is missing, too old or does not import."""
    version = require()
    try:
        return load_engine_class()
    except ImportError as e:
        raise ImportError(f"SGLang {version} is installed but its engine does not import ({e}); it needs its "
                          f"pinned torch and CUDA: {INSTALL_HINT}") from e


def rollout(cfg, model_path: str, processor=None, dtype: str = "bfloat16", seed: int = 0,
            hook_spec=None) -> SGLangRollout:
    """SGLang's engine started on the checkpoint `model_path` with the settings of `cfg`
    (rollplex.backends.BackendConfig), as the RL step's RolloutBackend. ImportError naming the install
    command when SGLang is missing, too old or does not import."""
    remote = cfg.sglang_pythonpath is not None
    version = require(cfg.sglang_pythonpath)
    if remote:
        from .remote import RemoteEngine

        engine_cls = functools.partial(RemoteEngine, pythonpath=cfg.sglang_pythonpath)
    else:
        engine_cls = engine_class()
    free0 = _device_free()
    engine = engine_cls(hook_spec=hook_spec, model_path=str(model_path), dtype=dtype,
                        mem_fraction_static=cfg.sglang_mem_fraction_static,
                        enable_memory_saver=cfg.sglang_memory_saver,
                        enable_weights_cpu_backup=cfg.sglang_weights_cpu_backup, random_seed=seed,
                        **cfg.extra_sglang_args())
    backend = SGLangRollout(engine, processor, release_weights=cfg.sglang_release_weights,
                            weights_cpu_backup=cfg.sglang_weights_cpu_backup,
                            bucket_bytes=cfg.sglang_weight_bucket_mb << 20, seed=seed,
                            version=engine.version if remote else version, memory_saver=cfg.sglang_memory_saver)
    # what SGLang's processes took (weights, KV pool, CUDA context; its mem_fraction_static is a share of
    # the device less what others already hold), measured: the step's memory plan fits into the rest. Its
    # releases outside the rollout are not counted back.
    backend.device_bytes = max(0, free0 - _device_free()) if free0 is not None else 0
    return backend


def _device_free() -> int | None:
    """Free bytes of the current CUDA device, all processes counted (None without CUDA)."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def cosched_hook(ref_path: str, dtype: str = "bfloat16", config: dict | None = None):
    """The HookSpec of the co-scheduler as SGLang's scheduler hook (cosched_hook.CoschedHook), its reference
    model loaded from `ref_path` in the scheduler process."""
    from .spec import HookSpec

    return HookSpec("engine_patches.sglang.cosched_hook:CoschedHook",
                    {"ref_path": str(ref_path), "dtype": dtype, "config": dict(config or {})})


def received_rows(exported: dict) -> dict:
    """{consumer: PrefixRows} from the engine's prefix_states(), for RolloutBatch.prefix."""
    from .cosched_hook import received_rows as rows

    return rows(exported)
