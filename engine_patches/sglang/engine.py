"""SGLang's Engine with Rollplex's hooked scheduler and the control RPCs that drive the hook.

`make_engine_class(base)` subclasses SGLang's Engine (`load_engine_class()` imports it):

    Engine(hook_spec=HookSpec(...), **server_args)   schedulers run the hooked Scheduler; each builds
                                                     the hook from the spec in its own process
    call(op, **params)                               one control op in every scheduler process
                                                     (Engine.collective_rpc -> Scheduler.rollplex_rpc);
                                                     rank 0's result
    start_admission(prompts) / stop_admission()      a rollout's prefix work beside decode (CoschedHook)
    hook_metrics()                                   decode-step counts + the hook's metrics
    prefix_states() / release_prefix_states()        the prefix states the hook made, mapped from the
                                                     scheduler's memory (CUDA IPC), and their release
    update_hook_weights(named_tensors)               refresh the hook's copy of the policy
    hook_weights(model)                              the hook's reference (or policy) parameters, mapped
                                                     from the scheduler's memory (no second copy)

SGLang's RPC parameters are flat scalars and its reply has no payload, so tensors and results travel
through files in a private directory (removed with the engine): tensors by CUDA IPC handle
(tensor_ipc.py), results as JSON written by each scheduler process (driver.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import weakref
from typing import Any

from .contract import RPC_METHOD, SERVER_ARG_RENAMES
from .driver import result_path
from .scheduler_patch import bind_hook, run_patched_scheduler_process
from .spec import HookSpec

_SCALARS = (str, int, float, bool, type(None))


class HookControl:
    """The hook's control ops over `self.call(op, **params)` and payload files at `self._path(what)`: shared by
    the in-process Engine subclass and the engine in its own process (remote.RemoteEngine)."""

    def start_admission(self, prompts: list) -> Any:
        """Start a rollout's co-scheduled prefix work on `prompts` (ModelInputs, in rollout order)."""
        from . import tensor_ipc

        path = self._path("prompts.pkl")
        tensor_ipc.dump(list(prompts), path)
        try:
            return self.call("start_admission", prompts_path=path)
        finally:
            os.unlink(path)

    def stop_admission(self) -> dict:
        return self.call("stop_admission")

    def hook_metrics(self) -> dict:
        return self.call("metrics")

    def prefix_states(self) -> dict:
        """{consumer: PrefixState} of the last rollout; valid until release_prefix_states()."""
        from . import tensor_ipc

        path = self._path("prefix.pkl")
        self.call("export_prefix_states", states_path=path)
        try:
            return tensor_ipc.load(path)
        finally:
            os.unlink(path)

    def release_prefix_states(self) -> None:
        self.call("release_prefix_states")

    def update_hook_weights(self, named_tensors: dict) -> Any:
        """Copy `named_tensors` (Rollplex parameter names) into the hook's policy model."""
        from . import tensor_ipc

        path = self._path("weights.pkl")
        tensor_ipc.dump(dict(named_tensors), path)
        try:
            return self.call("update_weights", weights_path=path)
        finally:
            os.unlink(path)

    def hook_weights(self, model: str = "ref") -> dict:
        """{parameter name: tensor} of the hook's `model` ("ref" | "policy"), mapped by CUDA IPC: they
        alias the scheduler process's memory (read-only use; valid while the engine runs)."""
        from . import tensor_ipc

        path = self._path("hook-weights.pkl")
        self.call("export_weights", model=model, weights_path=path)
        try:
            return tensor_ipc.load(path)
        finally:
            os.unlink(path)


def server_args_for(kwargs: dict, names: set[str] | None) -> dict:
    """`kwargs` with each server argument SGLang renamed (contract.SERVER_ARG_RENAMES) under the name this
    release takes; `names` are its ServerArgs fields (None: unknown, nothing renamed). ValueError when both
    names of one argument are given."""
    if names is None:
        return dict(kwargs)
    out = dict(kwargs)
    for old, (new, _) in SERVER_ARG_RENAMES.items():
        if old in out and new in out:
            raise ValueError(f"server arguments {old} and {new} are one argument: give one")
        for have, want in ((old, new), (new, old)):
            if have in out and have not in names and want in names:
                out[want] = out.pop(have)
    return out


def server_arg_names(server_args: type) -> set[str] | None:
    """The fields of SGLang's ServerArgs class (a dataclass up to 0.5.17, a msgspec Struct in 0.5.23; None when
    they cannot be read)."""
    if dataclasses.is_dataclass(server_args):
        return {f.name for f in dataclasses.fields(server_args)}
    names = set(getattr(server_args, "__struct_fields__", ()))
    names |= {n for c in server_args.__mro__ for n in vars(c).get("__annotations__", {})}
    return names or None


def make_engine_class(base: type, server_args: set[str] | None = None) -> type:
    """A subclass of `base` (SGLang's Engine) whose schedulers run Rollplex's hooked Scheduler; `server_args`
    (the release's ServerArgs fields) lets it pass renamed arguments under the release's names."""

    class RollplexEngine(HookControl, base):
        run_scheduler_process_func = staticmethod(run_patched_scheduler_process)

        def __init__(self, hook_spec: HookSpec | None = None, **kwargs):
            if hook_spec is not None and not isinstance(hook_spec, HookSpec):
                raise ValueError("hook_spec must be a HookSpec")
            if hook_spec is not None:  # read by SGLang's __init__ when it launches the schedulers
                self.run_scheduler_process_func = bind_hook(hook_spec)
            self.rollplex_dir = tempfile.mkdtemp(prefix="rollplex-sglang-")
            self._rollplex_calls = itertools.count()
            weakref.finalize(self, shutil.rmtree, self.rollplex_dir, True)
            super().__init__(**server_args_for(kwargs, server_args))

        # ---- control RPCs ---------------------------------------------------------------------
        def _path(self, what: str) -> str:
            return os.path.join(self.rollplex_dir, f"{next(self._rollplex_calls)}-{what}")

        def call(self, op: str, **params) -> Any:
            """Run control op `op` in every scheduler process; rank 0's result. RuntimeError with the
            scheduler's error when it fails there."""
            bad = [k for k, v in params.items() if not isinstance(v, _SCALARS)]
            if bad:
                raise ValueError(f"RPC parameters must be str, int, float, bool or None: {bad}")
            out = self._path(op)
            failure = None
            try:
                self.collective_rpc(RPC_METHOD, op=op, out_path=out, **params)
            except AssertionError as e:  # collective_rpc asserts the reply's success
                failure = str(e)
            path = result_path(out, 0)
            if not os.path.exists(path):
                raise RuntimeError(f"control op {op!r} left no result in the scheduler"
                                   + (f": {failure}" if failure else " (is the Rollplex scheduler running?)"))
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
            for rank_file in (p for p in os.listdir(self.rollplex_dir) if p.startswith(os.path.basename(out) + ".")):
                os.unlink(os.path.join(self.rollplex_dir, rank_file))
            if not res["ok"]:
                raise RuntimeError(f"control op {op!r} failed in the scheduler: {res['error']}")
            return res["result"]

    RollplexEngine.__name__ = RollplexEngine.__qualname__ = f"Rollplex{base.__name__}"
    RollplexEngine.__module__ = __name__
    return RollplexEngine


def load_engine_class() -> type:
    """make_engine_class over sglang.srt.entrypoints.engine.Engine (imports SGLang)."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

    return make_engine_class(Engine, server_arg_names(ServerArgs))
