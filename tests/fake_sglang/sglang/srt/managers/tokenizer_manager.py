"""The tokenizer manager's weight update, in the fake: the payload of the first TP rank, loaded into the
engine's runtime (SGLang deserializes it in each scheduler process)."""

from sglang.srt.utils.common import MultiprocessingSerializer


class TokenizerManager:
    def __init__(self, engine):
        self.engine = engine

    async def update_weights_from_tensor(self, obj, request):
        named_tensors = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        self.engine.memory_calls.append(("update", [n for n, _ in named_tensors], obj.flush_cache))
        if self.engine.runtime is not None:
            self.engine.runtime.update(named_tensors)
        return True, "Succeeded to update model weights."
