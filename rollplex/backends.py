"""Rollout backend selection: Rollplex's own engine (`native`) or SGLang (`sglang`, engine_patches/sglang).

`BackendConfig` is the choice and the SGLang backend's settings (the server nests it: `--rollout-backend`,
`--sglang-*`). SGLang is an optional dependency and is imported only when the SGLang backend is built:
`require_sglang()` checks that it is installed and recent enough, `sglang_engine_class()` returns
SGLang's Engine subclassed with Rollplex's hooked scheduler, and `sglang_rollout(...)` starts that
engine on a checkpoint and wraps it as the RL step's RolloutBackend. Every failure to find SGLang names
the install command.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import metadata

from engine_patches.sglang.contract import MANAGED_SERVER_ARGS, release_tuple

ROLLOUT_BACKENDS = ("native", "sglang")
INSTALL_HINT = "pip install 'rollplex[sglang]'"


@dataclass(frozen=True)
class BackendConfig:
    rollout_backend: str = "native"
    # the share of device memory SGLang takes for its weights and KV cache; the colocated trainer (policy,
    # reference, optimizer, activations) lives in the rest
    sglang_mem_fraction_static: float = 0.4
    # outside the rollout SGLang's weights are released (and copied in again before the next rollout);
    # False keeps them resident (more memory, no copy when nothing changed them)
    sglang_release_weights: bool = True
    # SGLang keeps a host copy of released weights (its enable_weights_cpu_backup)
    sglang_weights_cpu_backup: bool = False
    # the policy reaches SGLang in update_weights_from_tensor calls of at most this many MiB
    sglang_weight_bucket_mb: int = 512
    # further SGLang server arguments, a JSON object (e.g. '{"attention_backend": "fa3"}')
    sglang_args: str | None = None

    def __post_init__(self):
        check_backend(self.rollout_backend)
        if not 0.0 < self.sglang_mem_fraction_static < 1.0:
            raise ValueError(f"sglang_mem_fraction_static must be in (0, 1), got {self.sglang_mem_fraction_static}")
        if self.sglang_weight_bucket_mb < 1:
            raise ValueError("sglang_weight_bucket_mb must be >= 1")
        self.extra_sglang_args()

    def extra_sglang_args(self) -> dict:
        """sglang_args as a dict (ValueError when it is not a JSON object or sets a managed argument)."""
        if not self.sglang_args:
            return {}
        try:
            args = json.loads(self.sglang_args)
        except json.JSONDecodeError as e:
            raise ValueError(f"sglang_args must be a JSON object: {e}") from None
        if not isinstance(args, dict):
            raise ValueError(f"sglang_args must be a JSON object, got {type(args).__name__}")
        managed = sorted(set(args) & set(MANAGED_SERVER_ARGS))
        if managed:
            raise ValueError(f"sglang_args cannot set {managed}: the backend sets them (model and dtype from the "
                             "policy, mem_fraction_static and the weight backup from their own settings)")
        return args


def check_backend(name: str) -> str:
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {name!r}")
    return name


_release = release_tuple


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


def sglang_rollout(cfg: BackendConfig, model_path: str, processor=None, dtype: str = "bfloat16", seed: int = 0,
                   hook_spec=None):
    """SGLang's engine started on the checkpoint `model_path`, as the RL step's RolloutBackend
    (engine_patches.sglang.backend.SGLangRollout). ImportError naming the install command when SGLang
    is missing, too old or does not import."""
    version = require_sglang()
    engine_cls = sglang_engine_class()
    from engine_patches.sglang.backend import SGLangRollout

    engine = engine_cls(hook_spec=hook_spec, model_path=str(model_path), dtype=dtype,
                        mem_fraction_static=cfg.sglang_mem_fraction_static, enable_memory_saver=True,
                        enable_weights_cpu_backup=cfg.sglang_weights_cpu_backup, random_seed=seed,
                        **cfg.extra_sglang_args())
    return SGLangRollout(engine, processor, release_weights=cfg.sglang_release_weights,
                         weights_cpu_backup=cfg.sglang_weights_cpu_backup,
                         bucket_bytes=cfg.sglang_weight_bucket_mb << 20, seed=seed, version=version)
