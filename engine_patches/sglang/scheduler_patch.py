"""SGLang's Scheduler with Rollplex's decode hook, and the scheduler-process shim that installs it.

SGLang runs each scheduler in a process it spawns, from `Engine.run_scheduler_process_func`;
the spawned process imports SGLang afresh, so a class patched in the parent is not the one it runs.
`run_patched_scheduler_process` is that function's replacement: a module-level function (picklable by
name), it runs *in* the scheduler process, rebinds `sglang.srt.managers.scheduler.Scheduler` there to
the hooked subclass and calls SGLang's own `run_scheduler_process` with the arguments unchanged — which
builds the scheduler by that module-level name. A hook spec reaches it bound with functools.partial.

The hooked subclass (`make_hooked_scheduler(base, spec)`, a factory so that it can be built over any
base with the same shape — SGLang's Scheduler in production, a fake one in tests):

    __init__      SGLang's, then builds the hook from the spec (in this process, on its device context)
    run_batch     both event loops (normal and overlap) launch every batch through it; a decode batch
                  (`batch.forward_mode.is_decode()`) gets on_decode_step before the launch and
                  after_decode_launch once it is queued, timed with CUDA events on the stream decode
                  runs on (forward_stream with overlap scheduling, else the current one)
    rollplex_rpc  the one control RPC (Engine.collective_rpc -> handle_rpc_request -> this), see driver.py
    flush_cache   SGLang's, then, when it flushed, SGLang's multimodal embedding cache too: SGLang keeps
                  the vision tower's encodings keyed by the image's hash across weight updates, so
                  after a hand-over a repeated image would be encoded by the old policy's tower (the
                  weight update flushes through this method)

Everything the subclass touches on SGLang's objects is listed in contract.py.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from .driver import HookDriver
from .spec import HookSpec
from .timing import StepTimer

SGLANG_SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
# where SGLang keeps the module-level multimodal embedding cache (0.5.23 moved it out of mm_utils)
EMBEDDING_CACHE_MODULES = ("sglang.srt.managers.mm_schedule", "sglang.srt.managers.mm_utils")


def clear_embedding_cache() -> bool:
    """Empty SGLang's multimodal embedding cache in this process; False when there is none (not built yet,
    or a release without one)."""
    for name in EMBEDDING_CACHE_MODULES:
        cache = getattr(sys.modules.get(name), "embedding_cache", None)
        if cache is not None:
            cache.clear()
            return True
    return False


def device_clock() -> tuple[Any, Any]:
    """(event factory, current-stream getter) on a CUDA device, else (None, None).

    The scheduler process has imported torch and set its device by the time the hook is built; this
    never imports torch itself, so a process without it (tests) measures nothing."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None, None
    return (lambda: torch.cuda.Event(enable_timing=True)), torch.cuda.current_stream


def process_rank() -> int:
    """This process's torch.distributed rank (SGLang's TP group), 0 without one."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def make_hooked_scheduler(base: type, spec: HookSpec | None = None, clock=device_clock) -> type:
    """A subclass of `base` (SGLang's Scheduler) that calls the hook built from `spec` per decode launch."""

    class RollplexScheduler(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            make_event, current_stream = clock()
            hook = spec.build() if spec is not None else None
            self.rollplex = HookDriver(hook, StepTimer(make_event), process_rank(), current_stream)

        def run_batch(self, batch, *args, **kwargs):
            driver = getattr(self, "rollplex", None)  # None while SGLang's __init__ still runs
            if driver is None:
                return super().run_batch(batch, *args, **kwargs)
            if not batch.forward_mode.is_decode():
                driver.other_batch()
                return super().run_batch(batch, *args, **kwargs)
            stream = self.forward_stream if self.enable_overlap else None
            info = driver.before_decode(batch.batch_size(), len(self.waiting_queue), stream)
            result = super().run_batch(batch, *args, **kwargs)
            driver.after_decode(info)
            return result

        def flush_cache(self, *args, **kwargs):
            flushed = super().flush_cache(*args, **kwargs)
            if flushed:
                clear_embedding_cache()
            return flushed

        def rollplex_rpc(self, op: str, out_path: str, **params):
            """Control op `op` (driver.OPS) with `params`; the result goes to `out_path`.<rank>.json."""
            self.rollplex.control(op, out_path, params)

    RollplexScheduler.__name__ = RollplexScheduler.__qualname__ = f"Rollplex{base.__name__}"
    RollplexScheduler.__module__ = __name__
    return RollplexScheduler


def run_patched_scheduler_process(*args, hook_spec: HookSpec | None = None, **kwargs):
    """SGLang's run_scheduler_process(*args, **kwargs) with the hooked Scheduler; runs in the scheduler
    process (the Engine subclass's run_scheduler_process_func)."""
    module = sys.modules.get(SGLANG_SCHEDULER_MODULE)
    if module is None:
        import importlib

        module = importlib.import_module(SGLANG_SCHEDULER_MODULE)
    base = module.Scheduler
    if base.__module__ == __name__:  # one scheduler per process: a second shim call would stack subclasses
        raise RuntimeError("this process already runs a Rollplex-patched SGLang scheduler")
    module.Scheduler = make_hooked_scheduler(base, hook_spec)
    return module.run_scheduler_process(*args, **kwargs)


def bind_hook(hook_spec: HookSpec | None) -> functools.partial:
    """run_patched_scheduler_process bound to a hook spec (picklable: a module-level function and a spec)."""
    return functools.partial(run_patched_scheduler_process, hook_spec=hook_spec)
