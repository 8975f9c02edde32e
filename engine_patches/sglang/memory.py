"""Rollplex's phases on an SGLang engine: release and resume of SGLang's memory, and weight refresh.

With the SGLang backend the rollout runs on SGLang's own copy of the policy, KV cache and CUDA graphs;
outside the rollout they only hold memory. `SGLangMemoryAdapter.enter(phase)` mirrors
MemoryManager.enter for them, by SGLang's memory tags (contract.MEMORY_TAGS):

    rollout      everything resumed
    ref, update  kv_cache + cuda_graph released where the Rollplex plan does not keep the KV cache
                 resident (PhasePlan.get(phase, "kv_cache")); weights released when release_weights;
                 nothing when SGLang runs without its memory saver (memory_saver=False)

Released weights lose their contents (unless SGLang backs them up on the host:
`weights_cpu_backup=True`, matching its `enable_weights_cpu_backup`), and an update phase changes the
policy, so after either the adapter refuses to enter the rollout until `refresh_weights(...)` has
copied the policy in through `Engine.update_weights_from_tensor` — a rollout never samples from stale
weights. The refresh resumes the weights first and loads them while the KV cache is still released
(the most free memory for the copy), in buckets of `bucket_bytes`, flushing SGLang's prefix cache once
at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from rollplex.memory.ledger import Ledger
from rollplex.memory.plan import PHASES, PhasePlan

from .contract import MEMORY_TAGS


class SGLangMemoryAdapter:
    def __init__(self, engine, plan: PhasePlan | None = None, release_weights: bool = True,
                 weights_cpu_backup: bool = False, bucket_bytes: int = 512 << 20, ledger: Ledger | None = None,
                 memory_saver: bool = True):
        if bucket_bytes <= 0:
            raise ValueError("bucket_bytes must be > 0")
        self.engine, self.plan = engine, plan or PhasePlan.releases_only()
        self.release_weights, self.weights_cpu_backup = release_weights, weights_cpu_backup
        self.bucket_bytes, self.ledger = bucket_bytes, ledger
        self.memory_saver = memory_saver  # False: SGLang runs without its memory saver and keeps everything
        self.released: set[str] = set()
        self.weights_current = True  # SGLang's weights hold the policy's latest values
        self.phase: str | None = None

    def released_in(self, phase: str) -> tuple[str, ...]:
        """SGLang memory tags released during `phase`, in MEMORY_TAGS order."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; phases are {PHASES}")
        if phase == "rollout" or not self.memory_saver:
            return ()
        tags = {"weights"} if self.release_weights else set()
        if self.plan.get(phase, "kv_cache") != "resident":
            tags |= {"kv_cache", "cuda_graph"}
        return tuple(t for t in MEMORY_TAGS if t in tags)

    def enter(self, phase: str) -> None:
        want = set(self.released_in(phase))
        if phase == "rollout" and not self.weights_current:
            raise RuntimeError("SGLang's weights are stale (released or the policy was updated): call "
                               "refresh_weights(...) before entering the rollout")
        release = [t for t in MEMORY_TAGS if t in want and t not in self.released]
        resume = [t for t in MEMORY_TAGS if t not in want and t in self.released]
        if release:
            self._call("pause", self.engine.release_memory_occupation, release)
            self.released |= set(release)
            if "weights" in release and not self.weights_cpu_backup:
                self.weights_current = False
        if resume:
            self._call("resume", self.engine.resume_memory_occupation, resume)
            self.released -= set(resume)
        if phase == "update":
            self.weights_current = False  # the update changes the policy SGLang samples from
        self.phase = phase

    def refresh_weights(self, named_tensors: Iterable) -> int:
        """Copy the policy's (HF-named) tensors into SGLang's model; the number of update calls made."""
        if "weights" in self.released:
            self._call("resume", self.engine.resume_memory_occupation, ["weights"])
            self.released.discard("weights")
        buckets = list(_buckets(named_tensors, self.bucket_bytes))
        if not buckets:
            raise ValueError("refresh_weights needs the policy's named tensors (got none)")
        t0 = time.perf_counter()
        for i, bucket in enumerate(buckets):
            res = self.engine.update_weights_from_tensor(named_tensors=bucket, load_format=None,
                                                         flush_cache=i == len(buckets) - 1)
            if isinstance(res, tuple) and res and res[0] is False:  # SGLang answers (success, message)
                raise RuntimeError(f"SGLang did not load the policy's weights: {res[1] if len(res) > 1 else res}")
        if self.ledger is not None:
            self.ledger.record_transition("resume", "sglang/weight_refresh", time.perf_counter() - t0)
        self.weights_current = True
        return len(buckets)

    def _call(self, kind: str, fn, tags: list[str]) -> None:
        t0 = time.perf_counter()
        fn(tags=list(tags))
        if self.ledger is not None:
            self.ledger.record_transition(kind, "sglang/" + "+".join(tags), time.perf_counter() - t0)


def _buckets(named_tensors: Iterable, limit: int):
    bucket, size = [], 0
    for name, t in named_tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def hf_named_tensors(model) -> list:
    """A Rollplex model's weights under the HF names SGLang's loader takes, in the released checkpoints' layout.

    Qwen2.5-VL: `model.layers.*` / `visual.*` with q/k/v and gate/up split (the loader fuses them).
    Qwen3-VL: `model.language_model.*` / `model.visual.*`, q/k/v and gate/up split on the text side, the
    tower's `attn.qkv` fused and its patch embedding Conv3d-shaped, as SGLang's Qwen3-VL `load_weights`
    takes them (tests/test_sglang_qwen3_vl.py runs that method's source on them). SGLang skips a name it
    does not know without a word, so the names must be exactly these.

    `lm_head.weight` comes last: some releases (0.5.7) copy `embed_tokens` into `lm_head` whenever they
    load `embed_tokens`, tied or not, so an untied head sent before the embedding would be overwritten.
    A tied model sends no `lm_head.weight` (SGLang's head is the embedding).
    """
    from rollplex.models import rollplex_to_hf

    state = {k: v.detach() for k, v in model.state_dict().items()}
    named = rollplex_to_hf(state, model.cfg)
    head = named.pop("lm_head.weight", None)
    return list(named.items()) + ([("lm_head.weight", head)] if head is not None else [])
