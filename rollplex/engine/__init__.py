"""Native rollout engine: continuous batching over the shared model (see engine.py).

Exports resolve lazily so that the torch-free parts (scheduler, block manager, sequences, sampling
params) import without torch.
"""

from importlib import import_module

_EXPORTS = {
    "Engine": "engine", "RequestOutput": "engine", "SampleOutput": "engine", "EngineConfig": "config",
    "DecodeHook": "hooks", "DecodeStepInfo": "hooks", "RecordingHook": "hooks", "SamplingParams": "sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
