"""SGLang as Rollplex's rollout backend: SGLang decodes, Rollplex's hooks run in its scheduler process.

    contract.py         every SGLang name relied on (CONTRACT), the versions checked
    check.py            the contract checked by AST against a release's source (no SGLang import)
    spec.py             HookSpec: the picklable recipe of the hook built in each scheduler process
    timing.py           decode-step timing from CUDA events, read without waiting
    driver.py           per-scheduler hook state: DecodeStepInfo per decode launch, control RPCs
    scheduler_patch.py  the hooked Scheduler subclass (a factory over the base) and the process shim
    engine.py           the Engine subclass: launches the shim, control RPCs by collective_rpc
    memory.py           Rollplex phases -> SGLang release/resume tags; weight refresh
    tensor_ipc.py       tensors between processes through files (CUDA IPC handles)
    cosched_hook.py     the co-scheduler as a scheduler hook, and the trainer-side PrefixRows
    outputs.py          rollout requests in Engine.generate's form; SGLang's answers as RequestOutputs
    backend.py          SGLangRollout: SGLang as the RL step's RolloutBackend (rollplex/rl/rollout.py)
    plugin.py           what rollplex.backends finds under "sglang": the version check, the engine class,
                        SGLangRollout started on a checkpoint

Nothing here imports SGLang until `load_engine_class()` (or the shim, in the scheduler process) runs.
Exports resolve lazily so that the torch-free parts (contract, check, spec, timing) import without torch.
"""

from importlib import import_module

_EXPORTS = {
    "CONTRACT": "contract", "CHECKED_VERSIONS": "contract", "MIN_VERSION": "contract", "HookSpec": "spec",
    "StepTimer": "timing", "HookDriver": "driver", "make_hooked_scheduler": "scheduler_patch",
    "run_patched_scheduler_process": "scheduler_patch", "make_engine_class": "engine",
    "load_engine_class": "engine", "SGLangMemoryAdapter": "memory", "hf_named_tensors": "memory",
    "CoschedHook": "cosched_hook", "received_rows": "cosched_hook", "SGLangRollout": "backend",
    "generate_kwargs": "outputs", "request_outputs": "outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
