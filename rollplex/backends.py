"""Rollout backend selection: Rollplex's own engine (`native`) or a backend plugin found by name (`sglang`).

`BackendConfig` is the choice and the SGLang backend's settings (the server nests it: `--rollout-backend`,
`--sglang-*`). Every backend but the native engine is a plugin that lives outside `rollplex/` and imports
Rollplex, never the other way round: `PLUGINS` maps its name to its module (SGLang's is
engine_patches/sglang/plugin.py), imported only when that backend is checked or built, so an optional
engine costs nothing until it is asked for. A plugin module defines

    require(pythonpath=None) -> str
                                 the installed engine's version (under `pythonpath` when the engine runs
                                 in its own process); ImportError naming the install command when it is
                                 missing or too old
    check_args(args: dict)       ValueError for engine arguments that the backend sets itself
    rollout(cfg, model_path, processor, dtype, seed, hook_spec)
                                 the engine started on the checkpoint `model_path`, as the RL step's
                                 RolloutBackend

`require_backend(name)` and `rollout_backend(cfg, ...)` reach them; the native engine is built by its
caller, around the policy whose weights it shares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import import_module
from types import ModuleType

# backend name -> the module of its plugin (see the module docstring)
PLUGINS = {"sglang": "engine_patches.sglang.plugin"}
ROLLOUT_BACKENDS = ("native", *PLUGINS)


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
    # SGLang's memory saver (torch-memory-saver), which lets its weights and KV cache go outside the rollout;
    # False: SGLang keeps them (nothing is released, the policy is still copied in after each update)
    sglang_memory_saver: bool = True
    # further SGLang server arguments, a JSON object (e.g. '{"attention_backend": "fa3"}')
    sglang_args: str | None = None
    # run SGLang in a process of its own with this directory first on its PYTHONPATH (its own pinned
    # libraries, e.g. transformers), driven over a local socket; None: SGLang is imported in this process
    sglang_pythonpath: str | None = None

    def __post_init__(self):
        check_backend(self.rollout_backend)
        if not 0.0 < self.sglang_mem_fraction_static < 1.0:
            raise ValueError(f"sglang_mem_fraction_static must be in (0, 1), got {self.sglang_mem_fraction_static}")
        if self.sglang_weight_bucket_mb < 1:
            raise ValueError("sglang_weight_bucket_mb must be >= 1")
        if self.sglang_pythonpath is not None and not self.sglang_pythonpath:
            raise ValueError("sglang_pythonpath must name a directory (or be left unset)")
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
        if args:
            plugin("sglang").check_args(args)
        return args


def check_backend(name: str) -> str:
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"rollout_backend must be one of {ROLLOUT_BACKENDS}, got {name!r}")
    return name


def plugin(name: str) -> ModuleType:
    """The plugin module of the backend `name` (see the module docstring)."""
    if name not in PLUGINS:
        raise ValueError(f"{name!r} is not a plugin backend (those are {tuple(PLUGINS)})")
    return import_module(PLUGINS[name])


def require_backend(name: str, cfg: BackendConfig | None = None) -> str | None:
    """The installed version of the engine behind the backend `name` (None for the native engine, which is
    part of Rollplex), where `cfg` runs it (its own PYTHONPATH); ImportError naming the install command when
    it is missing or too old."""
    if check_backend(name) == "native":
        return None
    return plugin(name).require(cfg.sglang_pythonpath if cfg is not None else None)


def rollout_backend(cfg: BackendConfig, model_path: str, processor=None, dtype: str = "bfloat16", seed: int = 0,
                    hook_spec=None):
    """The plugin backend `cfg.rollout_backend` started on the checkpoint `model_path`, as the RL step's
    RolloutBackend. ImportError naming the install command when its engine is missing, too old or does not
    import."""
    return plugin(cfg.rollout_backend).rollout(cfg, model_path, processor, dtype, seed, hook_spec)
