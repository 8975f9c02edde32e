"""What the RL step needs from a rollout engine (`RolloutBackend`), and Rollplex's own engine behind it.

    generate(prompts, params, keep_vision)   ModelInputs + SamplingParams (one per prompt) -> one
                                             RequestOutput per prompt, in order (rollplex.engine's form,
                                             which RolloutBatch.from_outputs reads)
    reports_groups                           True when generate also takes `on_output(i, output)` and
                                             calls it as each prompt's group finishes (the native engine,
                                             from its decode loop): what the fused schedule consumes;
                                             its outputs' meta["finish_index"] then give the finishing
                                             order (RolloutBatch.finished: the first mini-batch)
    attach(model, memory)                    the policy the rollouts sample from and the step's memory
                                             manager (its plan and ledger); called once by RLStep
    enter_phase(phase)                       rollout / ref / update / update_critic: release or resume
                                             the backend's own memory for that phase; entering the
                                             rollout brings the backend's weights up to date with the
                                             policy first
    update_weights()                         the policy changed outside an update phase (a checkpoint
                                             load): copy it in
    kv_cache_bytes()                         bytes of KV cache the step's memory manager holds for it
    device_bytes                             device memory the backend holds outside the step's memory
                                             manager (SGLang's processes); the step's plan fits into the rest
    share(num_prompts)                       (the native engine's) the prompts whose prefill it runs, whose
                                             prefixes the co-scheduler computes beside its decode (None: all)
    close()

`rollout_requests` turns dataset rows into what `generate` takes, with seeds that depend only on the
step and the prompt.

`NativeRollout` wraps `rollplex.engine.Engine`: it decodes with the trainer's own parameter tensors and
allocates its KV cache in the step's memory manager, so it has no weights to copy and no memory of its
own to move (the manager's phases move its KV cache). The SGLang backend
(engine_patches.sglang.backend.SGLangRollout) holds its own copy of the policy and its own memory pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..data import ground_truth, row_to_inputs
from ..engine import Engine
from ..engine.sampling_params import SamplingParams
from .config import RLConfig
from .remax import greedy_samples


@runtime_checkable
class RolloutBackend(Protocol):
    name: str
    processor: object

    def generate(self, prompts: Sequence, params: Sequence, keep_vision: bool = False) -> list: ...

    def attach(self, model, memory) -> None: ...

    def enter_phase(self, phase: str) -> None: ...

    def update_weights(self) -> None: ...

    def kv_cache_bytes(self) -> int: ...

    device_bytes: int

    def close(self) -> None: ...


class NativeRollout:
    """Rollplex's engine as a RolloutBackend (`engine`: the rollplex.engine.Engine it drives)."""

    name = "native"
    reports_groups = True
    device_bytes = 0  # its KV cache is a region of the step's memory manager

    def __init__(self, engine):
        self.engine = engine
        self.processor = engine.processor

    def generate(self, prompts: Sequence, params: Sequence, keep_vision: bool = False, on_output=None) -> list:
        return self.engine.generate(prompts, params, keep_vision=keep_vision, on_output=on_output)

    def attach(self, model, memory) -> None:
        if self.engine.model is not model:
            raise ValueError("the engine must decode with the actor's own model (shared weights)")
        if memory is not None and self.engine.memory is not memory:
            raise ValueError("the engine and the RL step must share one memory manager")

    def enter_phase(self, phase: str) -> None:
        """Nothing of its own: its KV cache is a region of the step's memory manager."""

    def update_weights(self) -> None:
        """Nothing to copy: it decodes with the policy's own tensors."""

    def kv_cache_bytes(self) -> int:
        return self.engine.runner.kv_cache_bytes()

    def share(self, num_prompts: int) -> list[int] | None:
        return None  # every prompt: one engine

    def close(self) -> None:
        """The engine holds no process or thread of its own."""


def as_rollout_backend(engine) -> RolloutBackend | None:
    """A RolloutBackend for `engine`: a rollplex Engine (wrapped), a backend (as is) or None."""

    if isinstance(engine, Engine):
        return NativeRollout(engine)
    if engine is None or isinstance(engine, RolloutBackend):
        return engine
    raise ValueError(f"expected a rollplex Engine or a RolloutBackend, got {type(engine).__name__}")


def rollout_requests(processor, rows: list[dict], cfg: RLConfig, step_idx: int) -> tuple[list, list, dict]:
    """(prompts, sampling params, per-prompt extras) of step `step_idx`'s rollout of `rows`. The seeds
    depend only on (cfg.seed, step, prompt): wherever a prompt is generated, its samples are the same.
    ReMax (adv_estimator="remax") asks each prompt for one greedy continuation beside its n samples."""

    prompts = [row_to_inputs(processor, r) for r in rows]
    params = [SamplingParams(n=cfg.n, temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                             seed=(cfg.seed * 1_000_003 + step_idx * 10_007 + i * 101) % 2**62,
                             n_greedy=greedy_samples(cfg))
              for i in range(len(rows))]
    return prompts, params, dict(data_sources=[r.get("data_source") for r in rows],
                                 ground_truths=[ground_truth(r) for r in rows],
                                 extra_infos=[r.get("extra_info") for r in rows])
