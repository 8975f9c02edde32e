"""A picklable description of the decode hook to build inside each SGLang scheduler process.

The hook (a CoScheduler, a recorder, ...) must live in the scheduler process: it launches work on the
same device context as SGLang's decode steps and reads their timing events. Objects holding CUDA state
do not pickle across `spawn`, so the parent passes `HookSpec("package.module:factory", kwargs)` and the
scheduler process calls `factory(**kwargs)` once its model and KV cache are set up.
"""

from __future__ import annotations

import importlib
import pickle
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HookSpec:
    factory: str  # "package.module:callable", importable in the scheduler process
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        module, sep, attr = self.factory.partition(":")
        if not sep or not module or not attr or not all(p.isidentifier() for p in (*module.split("."), attr)):
            raise ValueError(f"hook factory must be 'package.module:callable', got {self.factory!r}")
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            raise ValueError("hook kwargs must be a dict with string keys")
        try:
            pickle.dumps(self.kwargs)
        except Exception as e:  # noqa: BLE001 - any pickling failure means the spec cannot reach the process
            raise ValueError(f"hook kwargs must be picklable (they travel to the scheduler process): {e}") from None

    def build(self) -> Any:
        """The hook: factory(**kwargs). TypeError when it has no on_decode_step."""
        module, _, attr = self.factory.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        hook = fn(**self.kwargs)
        if not callable(getattr(hook, "on_decode_step", None)):
            raise TypeError(f"{self.factory} returned {type(hook).__name__}, which has no on_decode_step(info)")
        return hook
