"""SGLang as the RL step's rollout backend (rollplex.rl.rollout.RolloutBackend).

    SGLangRollout(engine, processor, ...)   engine: SGLang's Engine (RollplexEngine, engine.py), already
                                            started on the policy's checkpoint
    generate(prompts, params, on_output=)   one SGLang request per sample (outputs.generate_kwargs),
                                            answers as RequestOutputs (outputs.request_outputs);
                                            with on_output(i, output), each prompt's group is reported
                                            as its n samples finish (below)
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

Groups as they finish (`reports_groups`: the fused schedule trains finished groups beside the rollout's
tail): each prompt's n sample requests go to SGLang as one batch request (groups.iter_groups, or the
engine's own `generate_groups` when SGLang runs in its own process), all of them at once, so SGLang's
scheduler batches every sample as in one `generate` call; a batch request answers when its last sample
finishes, and its prompt is reported then, in finishing order (`meta["finish_index"]`, the native
engine's convention). The requests and seeds are those of one `generate` call, prompt-major. If
reporting fails, the prompts still decoding are cancelled and the error is raised.

`engine` is SGLang's Engine in this process (engine.RollplexEngine) or in its own one
(remote.RemoteEngine, with SGLang's own PYTHONPATH); both take the same calls.

SGLang keeps no vision encodings for the trainer, so `keep_vision` has no effect here: a frozen vision
tower runs in scoring as without it. Its KV cache lives in SGLang's memory pool, outside the step's
memory manager (`kv_cache_bytes()` is 0); `device_bytes` is what SGLang's processes took of the device when
they started (plugin.rollout measures it), which the step's memory plan leaves to them.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from rollplex.memory.plan import PhasePlan

from .contract import IMAGE_PROMPTS_MIN_VERSION, release_tuple
from .groups import iter_groups
from .memory import SGLangMemoryAdapter, hf_named_tensors
from .outputs import generate_kwargs, request_outputs, sample_seeds


class SGLangRollout:
    name = "sglang"
    reports_groups = True
    device_bytes = 0  # set by plugin.rollout: the device memory SGLang took at its start

    def __init__(self, engine, processor=None, release_weights: bool = True, weights_cpu_backup: bool = False,
                 bucket_bytes: int = 512 << 20, seed: int = 0, version: str | None = None, memory_saver: bool = True):
        """version: the installed SGLang's; image prompts need IMAGE_PROMPTS_MIN_VERSION or newer. memory_saver:
        whether SGLang runs with its memory saver (without it nothing is released outside the rollout)."""
        self.engine, self.processor = engine, processor
        self.memory_adapter = SGLangMemoryAdapter(engine, None, release_weights, weights_cpu_backup, bucket_bytes,
                                                  memory_saver=memory_saver)
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

    def generate(self, prompts: Sequence, params: Sequence, keep_vision: bool = False, on_output=None) -> list:
        if len(prompts) != len(params):
            raise ValueError("one SamplingParams per prompt")
        if any(getattr(sp, "n_greedy", 0) for sp in params):
            raise ValueError("the sglang rollout backend does not roll out greedy continuations (n_greedy, "
                             "adv_estimator='remax'): use the native backend")
        if not prompts:
            return []
        if not self.image_prompts and any(p.image_grids for p in prompts):
            raise ValueError(f"image prompts need SGLang >= {IMAGE_PROMPTS_MIN_VERSION} (installed: {self.version}): "
                             "older releases place processor_output images at text positions (M-RoPE)")
        if self.memory_adapter.phase != "rollout":
            self.enter_phase("rollout")
        kw = generate_kwargs(prompts, params, sample_seeds(params, self._rng))
        rids = [f"sglang-{next(self._ids)}" for _ in prompts]
        if on_output is not None:
            return self._grouped(prompts, params, kw, rids, on_output)
        return request_outputs(prompts, params, self.engine.generate(**kw), self._decode, rids)

    def _grouped(self, prompts: Sequence, params: Sequence, kw: dict, rids: list, on_output) -> list:
        """`generate`'s requests as one batch request per prompt, each reported when it answers."""
        starts = list(itertools.accumulate((sp.n for sp in params), initial=0))
        # an engine in its own process streams the groups from there (remote.RemoteEngine.generate_groups)
        stream = getattr(self.engine, "generate_groups", None)
        answers = stream(kw, starts) if stream is not None else iter_groups(self.engine, kw, starts)
        outs: list = [None] * len(prompts)
        try:
            for finished, (i, raw) in enumerate(answers):
                out = request_outputs([prompts[i]], [params[i]], raw, self._decode, [rids[i]])[0]
                out.meta["finish_index"] = finished
                outs[i] = out
                on_output(i, out)
        finally:
            answers.close()  # cancels the prompts still decoding when reporting failed
        return outs

    @property
    def _decode(self):
        """Token ids -> text by the processor; None: SGLang's own text is kept."""
        if self.processor is None:
            return None
        return lambda ids, skip: self.processor.decode(ids, skip_special_tokens=skip)

    def kv_cache_bytes(self) -> int:
        return 0

    def close(self) -> None:
        self.engine.shutdown()
