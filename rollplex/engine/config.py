"""Engine configuration (one frozen dataclass, validated)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..kernels import paged_attention, split_k, swiglu_gemm
from .scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    # tokens per KV block. None: 64 on CUDA, where the TMA attention kernel reads one block per pipelined
    # tile, the fastest attention on the H200 (docs/BENCHMARKS.md); 16 on CPU (finer preemption and
    # sharing in small test budgets)
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    kv_cache_tokens: int | None = None  # explicit KV budget in tokens; default: 65536 on CPU, profiled on GPU
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine may fill (weights + KV + work)
    cuda_graph: bool = True  # capture decode per batch-size bucket (GPU only)
    cuda_graph_max_bs: int = 256
    # torch.compile the engine's own decode-layer functions (fused norms/residuals/SwiGLU) before
    # capturing graphs. None: on CUDA. The model is left as given: its owner decides whether its
    # forward (prefill, vision tower) is compiled (Qwen25VL.compile).
    compile_decode: bool | None = None
    seed: int = 0  # draws the seeds of requests that bring none
    # launch decode step N+1 before step N's tokens reach the host: the host's bookkeeping of N (append,
    # stop checks, scheduling) overlaps the GPU running N+1. Same outputs; a sequence that stops on a
    # token costs one discarded extra step.
    overlap_schedule: bool = True
    # graphed decode: (S_o, S_down) K slices of the o and down projections, run as one batched GEMM
    # with fp32 partials that the next residual-add + norm sums (engine/decode_forward.py). None:
    # timed per batch-size bucket at capture (GPU) / off (eager); (1, 1): plain GEMMs everywhere.
    decode_split_k: tuple[int, int] | None = None
    # graphed decode: time the Triton gate_up GEMM with SwiGLU in its epilogue (kernels/swiglu_gemm.py)
    # against cuBLAS + the compiled SwiGLU per bucket, and use it where faster. False: never.
    decode_fused_swiglu: bool = True
    # the launch configs the tuners time per graphed bucket; None: the kernel package's defaults
    # (kernels.paged_attention.DECODE_CANDIDATES, kernels.split_k.SPLIT_K_CANDIDATES,
    # kernels.swiglu_gemm.SWIGLU_CANDIDATES). attn_candidates: (num_splits, tile) pairs.
    attn_candidates: tuple[tuple[int | None, dict], ...] | None = None
    split_k_candidates: tuple[int, ...] | None = None
    swiglu_candidates: tuple[tuple[int, ...], ...] | None = None
    # where the tuners' picks are kept between runs, keyed by GPU, torch / triton versions, kernel
    # sources, shapes and candidates (kernels/tuning_cache.py): "auto" = $ROLLPLEX_CACHE_DIR/tuning,
    # else ~/.cache/rollplex/tuning; None or "" = off (every start times the candidates again)
    tuning_cache_dir: str | None = "auto"
    # (tensor parallelism is not configured here: the engine is given the plan its model was split by,
    # Engine(..., tp=rollplex.parallel.apply_tensor_parallel(model, group)))
    # tensor-parallel decode draws from each rank's vocabulary shard (engine/vocab_parallel_sampler.py: two
    # all-reduces of [B] and an all-gather of [3, B]) instead of gathering the [B, V] logits; a batch
    # with top-k / top-p / min-p rows gathers them anyway. False: always gather
    vocab_parallel_sampling: bool = True
    # lossless speculative decoding in the rollout's tail (engine/speculative.py): up to this many draft
    # tokens per sequence and step, drafted from the request's other samples (and the prompt cache),
    # verified by the policy in one pass; sampled tokens and logprobs are distributed exactly as without
    # it. 0: off (the default). It runs only while no request waits and at most
    # `speculative_max_batch` sequences decode, and at most `speculative_max_fraction` of the most that
    # decoded at once since the engine was last idle (1.0: no such limit); else decode runs as usual.
    speculative_tokens: int = 0
    speculative_max_batch: int = 32
    speculative_max_fraction: float = 0.25
    speculative_ngram: int = 6  # longest context the drafter matches
    # prompts whose earlier responses draft for a later request of the same prompt (images included
    # in the key); 0: only the request's own samples draft
    speculative_prompt_cache: int = 0
    # a verification that accepts fewer draft tokens per sequence than this backs speculation off: decode
    # steps run the plain overlapped path, drafting on the host in shadow, until the latest shadow drafts
    # (scored against the tokens plain decoding draws) accept this many per sequence again
    speculative_min_accepted: float = 0.5
    # also back off where a verification accepted fewer tokens than it costs: with the tail's measured step
    # times, verification ms / decode-step ms - 1 accepted tokens per sequence pay for the pass (where the
    # pass is dear, e.g. host-bound, speculation at a low acceptance is slower than decoding)
    speculative_adaptive: bool = False

    def __post_init__(self):
        if self.block_size not in (None, 16, 32, 64):
            raise ValueError("block_size must be 16, 32, 64 or None (chosen per device)")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.98]")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2 * (self.block_size or 16):
            raise ValueError("kv_cache_tokens must cover at least two blocks")
        if self.decode_split_k is not None and (
                len(self.decode_split_k) != 2 or any(not isinstance(s, int) or s < 1 for s in self.decode_split_k)):
            raise ValueError(f"decode_split_k must be two positive ints (S_o, S_down), got {self.decode_split_k}")
        if self.attn_candidates is not None:
            paged_attention.check_candidates(self.attn_candidates)
        if self.split_k_candidates is not None:
            split_k.check_candidates(self.split_k_candidates)
        if self.swiglu_candidates is not None:
            swiglu_gemm.check_candidates(self.swiglu_candidates)
        if self.tuning_cache_dir is not None and not isinstance(self.tuning_cache_dir, str):
            raise ValueError(f"tuning_cache_dir must be a directory, 'auto', '' or None, got {self.tuning_cache_dir!r}")
        if not 0 <= self.speculative_tokens <= 16:
            raise ValueError(f"speculative_tokens must be in [0, 16] (0: off), got {self.speculative_tokens}")
        if self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not 0.0 < self.speculative_max_fraction <= 1.0:
            raise ValueError(f"speculative_max_fraction must be in (0, 1], got {self.speculative_max_fraction}")
        if not 1 <= self.speculative_ngram <= 32:
            raise ValueError(f"speculative_ngram must be in [1, 32], got {self.speculative_ngram}")
        if not 0.0 <= self.speculative_min_accepted <= 16.0:
            raise ValueError(f"speculative_min_accepted must be in [0, 16], got {self.speculative_min_accepted}")
        if self.speculative_prompt_cache < 0:
            raise ValueError(f"speculative_prompt_cache must be >= 0, got {self.speculative_prompt_cache}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)

    @property
    def speculative_rows(self) -> int:
        """Rows of the largest verification pass (0 when speculation is off)."""
        return self.speculative_max_batch * (self.speculative_tokens + 1) if self.speculative_tokens else 0

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with the per-device defaults filled in (block_size)."""
        if self.block_size is not None:
            return self
        return replace(self, block_size=64 if device_type == "cuda" else 16)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len)
