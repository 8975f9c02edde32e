"""SGLang as the RL step's rollout backend (rollplex.rl.rollout.RolloutBackend).

    SGLangRollout(engine, processor, ...)   engine: SGLang's Engine (RollplexEngine, engine.py), already
                                            started on the policy's checkpoint
    generate(prompts, params)               one SGLang request per sample (outputs.generate_kwargs),
                                            answers as RequestOutputs (outputs.request_outputs)
    attach(model, memory)                   the trainer's policy (whose weights SGLang mirrors) and the
                                            step's memory manager (its phase plan and ledger)
    enter_phase(phase)                      SGLang's memory by the plan (memory.SGLangMemoryAdapter);
                                            entering the rollout copies the policy in first when
                                            SGLang's copy is stale
    update_weights()                        copy the policy in now (update_weights_from_tensor)

SGLang holds its own copy of the policy. It is stale after every update phase (the optimizer moved the
policy) and after a release of its weights without a host backup, and it starts stale: the trainer's
policy may differ from the checkpoint SGLang loaded (a warm-up, a resumed run). The copy is made
once per step, when the next rollout phase begins — after the update phase's optimizer and gradients
went back to the memory manager, and before SGLang's KV cache is resumed — not after each of a step's
mini-batch optimizer steps, since nothing samples in between.

SGLang keeps no vision encodings for the trainer, so `keep_vision` has no effect here: a frozen vision
tower runs in scoring as without it. Its KV cache lives in SGLang's memory pool, outside the step's
memory manager (`kv_cache_bytes()` is 0).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from rollplex.memory.plan import PhasePlan

from .contract import IMAGE_PROMPTS_MIN_VERSION, release_tuple
from .memory import SGLangMemoryAdapter, hf_named_tensors
from .outputs import generate_kwargs, request_outputs, sample_seeds


class SGLangRollout:
    name = "sglang"

    def __init__(self, engine, processor=None, release_weights: bool = True, weights_cpu_backup: bool = False,
                 bucket_bytes: int = 512 << 20, seed: int = 0, version: str | None = None):
        """version: the installed SGLang's; image prompts need IMAGE_PROMPTS_MIN_VERSION or newer."""
        self.engine, self.processor = engine, processor
        self.memory_adapter = SGLangMemoryAdapter(engine, None, release_weights, weights_cpu_backup, bucket_bytes)
        self.memory_adapter.weights_current = False  # the policy is copied in before the first rollout
        self.version = version
        self.image_prompts = version is None or release_tuple(version) >= release_tuple(IMAGE_PROMPTS_MIN_VERSION)
        self.model = None
        self.memory = None
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.weight_pushes = 0

    # ---- RolloutBackend ---------------------------------------------------------------------------
    def attach(self, model, memory) -> None:
        self.model, self.memory = model, memory
        self.memory_adapter.ledger = memory.ledger if memory is not None else None

    def enter_phase(self, phase: str) -> None:
        mem = self.memory_adapter
        mem.plan = self.memory.plan if self.memory is not None else PhasePlan.releases_only()
        if phase == "rollout" and not mem.weights_current:
            self.update_weights()
        mem.enter(phase)

    def update_weights(self) -> None:
        if self.model is None:
            raise RuntimeError("no policy attached: RLStep attaches the model whose weights SGLang mirrors")
        self.memory_adapter.refresh_weights(hf_named_tensors(self.model))
        self.weight_pushes += 1

    def generate(self, prompts: Sequence, params: Sequence, keep_vision: bool = False) -> list:
        if len(prompts) != len(params):
            raise ValueError("one SamplingParams per prompt")
        if not prompts:
            return []
        if not self.image_prompts and any(p.image_grids for p in prompts):
            raise ValueError(f"image prompts need SGLang >= {IMAGE_PROMPTS_MIN_VERSION} (installed: {self.version}): "
                             "older releases place processor_output images at text positions (M-RoPE)")
        if self.memory_adapter.phase != "rollout":
            self.enter_phase("rollout")
        kw = generate_kwargs(prompts, params, sample_seeds(params, self._rng))
        raw = self.engine.generate(**kw)
        decode = None
        if self.processor is not None:
            def decode(ids, skip):
                return self.processor.decode(ids, skip_special_tokens=skip)
        rids = [f"sglang-{next(self._ids)}" for _ in prompts]
        return request_outputs(prompts, params, raw, decode, rids)

    def kv_cache_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.engine.shutdown()
