"""A colocated data-parallel rank's rollout backend: the prompts dealt over the rollout groups' engines."""

from __future__ import annotations

from ..rl.rollout import NativeRollout


class DataParallelRollout(NativeRollout):
    """A `Colocated` rank's engine as the step's rollout backend: the prompts dealt round-robin over the rollout
    groups, each group's engine generating its share, every rank getting every output (`Colocated.generate`);
    the co-scheduler's share is the prompts this rank's engine prefilled (`Colocated.share`)."""

    def __init__(self, rank):
        super().__init__(rank.engine)
        self.rank = rank

    def generate(self, prompts, params, keep_vision: bool = False, on_output=None) -> list:
        return self.rank.generate(prompts, params, keep_vision=keep_vision, on_output=on_output)

    def share(self, num_prompts: int) -> list[int]:
        return self.rank.share(num_prompts)

    def attach(self, model, memory) -> None:
        """The engine decodes the rank's policy (or its tensor-parallel shard); it must share the step's memory."""
        if memory is not None and self.engine.memory is not memory:
            raise ValueError("the engine and the RL step must share one memory manager")
