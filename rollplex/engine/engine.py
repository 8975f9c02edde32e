"""The rollout engine: `Engine.generate(prompts, params)` over a continuous-batching loop.

    step():  batch = scheduler.schedule()
             prefill batch -> runner.prefill (vision + prompt once per request), fork KV to the n
                              samples, each sample draws its first token from the shared logits
             decode batch  -> hooks.on_decode_step(info); launch runner.decode (graphed on GPU) +
                              sample; then resolve the step launched before: append its tokens,
                              check stop conditions, free finished sequences

Overlap scheduling: a decode step is launched before the previous step's tokens reach the host (its
input ids are gathered from that step's device output), so the host's bookkeeping runs while the
GPU decodes. Host-side lengths count the in-flight token (`Sequence.pending`); a sequence that a
token stops is found one step late and its extra token is dropped. Outputs equal the plain loop
(`overlap_schedule=False`), which the tests hold.

Speculative decoding (`EngineConfig.speculative_tokens`, off by default; speculative.py): in the
rollout's tail (no request waiting, few sequences decoding) a decode step becomes a verification
step — drafts from the request's other samples, one pass of the policy over each sequence's last token
+ draft, the engine's own seeded draws accept the draft while they match it — which keeps every
token (and logprob) exactly what plain decoding gives. Verification steps are synchronous; the plain
path is unchanged but for drafting in shadow on the host while speculation is backed off.

The engine decodes with the model object it is given — the trainer's — so there is no weight copy
and no sync phase. It reads that model and never modifies it: prefill runs the model's own forward
(compiled if its owner compiled it, `Qwen25VL.compile`), decode runs the engine's own layer function
over the model's parameters (`DecodeForward`); a tensor-parallel model's split is the plan the engine
is given (`tp`), never read off the model. The server and the RL step both drive it through
`generate` (or add_request/step). `add_request` = `prepare` (encode + validate; touches no engine
state, so the server runs it off the engine thread) + `add` (queue it; the engine's thread).

Isolation: a request whose own work fails inside a step (its sampling row, its stop check, its output,
its prefill) is dropped alone: its sequences are aborted, `step` returns its output with `error` set,
and the other requests go on unchanged. A failing prefill batch is retried one request at a time to
find the failing one; a failing sampling-row build is split the same way. Only these failure paths pay
for it: the decode loop's normal path adds a try block and no work. A failure that no single request
owns (the batched decode forward) still raises out of `step`.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..models import ModelInputs, Qwen25VL
from .block_manager import BlockManager
from .config import EngineConfig
from .hooks import DecodeHook, DecodeStepInfo
from .model_runner import ModelRunner, TensorParallelPlan
from .sampler import Sampler, SamplingTensors
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence
from .speculative import Speculator
from .vocab_parallel_sampler import VocabParallelSampler


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None
    text: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    samples: list[SampleOutput]
    input_token_logprobs: list[float | None] | None = None
    meta: dict = field(default_factory=dict)
    vision_embeds: torch.Tensor | None = None  # the prefill's visual features (add_request(keep_vision=True))
    error: Exception | None = None  # the request failed in a step and was dropped (samples: what it had)
    greedy: list[SampleOutput] = field(default_factory=list)  # the n_greedy greedy continuations


class Engine:
    def __init__(self, model: Qwen25VL, processor=None, config: EngineConfig | None = None,
                 hooks: Seq[DecodeHook] = (), memory=None, tp: TensorParallelPlan | None = None):
        """memory: a MemoryManager to allocate the KV cache in (its `kv_cache` region); the engine only runs
        while that region is resident. tp: the tensor-parallel plan `model` was split by
        (rollplex.parallel.apply_tensor_parallel: every rank of its group runs an engine with the same
        requests in the same order, decode all-reduces the row-parallel outputs, and all ranks sample the
        same tokens); None: the model is whole."""
        self.model, self.processor, self.memory, self.tp = model, processor, memory, tp
        self.cfg = (config or EngineConfig()).for_device(next(model.parameters()).device.type)
        if self.cfg.speculative_tokens and tp is not None:
            raise ValueError("speculative decoding (speculative_tokens > 0) is not supported under tensor parallelism")
        self.runner = ModelRunner(model, self.cfg, memory, tp)
        self.blocks = BlockManager(self.runner.num_blocks, self.cfg.block_size)
        self.scheduler = Scheduler(self.cfg.scheduler_config(), self.blocks)
        self.hooks = list(hooks)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(self.cfg.seed)
        self._ids = itertools.count()
        self.decode_steps = 0
        self._last_step_ms: float | None = None
        self._last_period_ms: float | None = None
        self._last_end: tuple[int, object] | None = None  # (step, end event) of the last resolved step
        self._last_forward: tuple[int, float] | None = None  # (step, device ms of its forward alone)
        self._last_launch_ms: float | None = None  # host ms the last decode launch took (hooks on)
        self._idle_ms = 0.0  # how long the host waited for the last decode step (work done ahead uses a share)
        self._inflight: _Inflight | None = None  # a launched decode step whose tokens are not applied yet
        self._failed: dict[str, Exception] = {}  # requests dropped in this step, by id (see `_drop`)
        self.eos_token_id = model.cfg.eos_token_id
        on_gpu = self.runner.device.type == "cuda"
        self.stream = torch.cuda.current_stream(self.runner.device) if on_gpu else None
        self.sampler = Sampler(compile=on_gpu)
        # what draws a decode step's tokens: under tensor parallelism from each rank's vocabulary shard
        self.decode_sampler = self.sampler
        if self.runner.vocab_parallel:
            self.decode_sampler = VocabParallelSampler(tp, model.cfg.text.vocab_size, self.sampler)
        # speculative decoding in the tail (speculative.py); None: off
        self.spec = Speculator(self.cfg) if self.cfg.speculative_tokens else None
        self._verify_events = None  # around each verification's GPU work (its share of the step's time)
        if self.spec is not None and self.runner.device.type == "cuda":
            self._verify_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))

    @property
    def spec_stats(self) -> dict:
        """Speculation's counts since the engine started (empty with speculation off)."""
        return {} if self.spec is None else self.spec.stats.as_dict()

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32, config: EngineConfig | None = None, **kw):
        """An engine over a model it loads, and so owns: on CUDA it compiles that model's forward too
        (unless config.compile_decode is False)."""
        from ..models import load_model
        from ..processor import VLProcessor

        model = load_model(path, device, dtype).eval()
        if model.inv_freq.is_cuda and (config is None or config.compile_decode is not False):
            model.compile()
        return cls(model, VLProcessor.from_pretrained(path), config, **kw)

    # ---- requests -----------------------------------------------------------------------------
    def encode(self, prompt, processor=None) -> ModelInputs:
        """ModelInputs from: ModelInputs, list[int], str (templated text), or a dict with
        `input_ids` | `text` | `messages` plus optional `images` / `videos`. processor: the one to
        encode with (default: the engine's)."""
        if isinstance(prompt, ModelInputs):
            return prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return ModelInputs(input_ids=list(prompt))
        if isinstance(prompt, dict) and "input_ids" in prompt and not prompt.get("images") and not prompt.get("videos"):
            return ModelInputs(input_ids=[int(t) for t in prompt["input_ids"]])
        processor = processor or self.processor
        if processor is None:
            raise ValueError("this engine has no processor: pass token ids or ModelInputs")
        if isinstance(prompt, str):
            return processor.encode(text=prompt)
        if isinstance(prompt, dict):
            return processor.encode(text=prompt.get("text"), messages=prompt.get("messages"),
                                    images=prompt.get("images"), videos=prompt.get("videos"))
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def prepare(self, prompt, params: SamplingParams | None = None, processor=None,
                keep_vision: bool = False) -> Request:
        """Encode and validate one request without touching the engine's running state (it reads the
        model config and the cache size, both fixed), so a server can prepare requests on another
        thread while this one decodes. ValueError for anything the engine could never run: token ids
        outside the vocabulary, images that do not match their placeholders, a prompt longer than
        max_model_len or than the whole KV cache. processor: the one to encode with (default: the
        engine's; a tokenizer is not safe to share between threads, so another thread brings its own).
        keep_vision: return the prefill's visual features in the output (they can stand in for the
        vision tower of a frozen-vision trainer, `ModelInputs.vision_embeds`)."""
        params = params or SamplingParams()
        if params.num_seqs > self.cfg.max_num_seqs:
            raise ValueError(f"n={params.n} (+ n_greedy={params.n_greedy}) exceeds "
                             f"max_num_seqs={self.cfg.max_num_seqs}")
        inputs = self.encode(prompt, processor)
        vocab = self.model.cfg.text.vocab_size
        if not inputs.input_ids or any(not 0 <= t < vocab for t in inputs.input_ids):
            raise ValueError(f"prompt token ids must be non-empty and within [0, {vocab})")
        mcfg, delta = self.model.cfg, 0
        if inputs.image_grids or inputs.video_grids or not {mcfg.image_token_id, mcfg.video_token_id}.isdisjoint(
                inputs.input_ids):  # text-only prompts: positions 0..L-1 on all three axes, delta 0
            # ValueError on placeholders that do not match the images (the model's family places them)
            _, delta = self.model.prompt_positions(list(inputs.input_ids), inputs)
        req = Request("", inputs, params, [0] * params.num_seqs, rope_delta=delta)  # id and seeds: `add`
        req.max_len = min(req.num_prompt_tokens + params.max_new_tokens, self.cfg.max_model_len)
        req.keep_vision = keep_vision
        self.scheduler.check(req)  # reads only the limits and the cache size
        return req

    def add(self, req: Request, request_id: str | None = None) -> str:
        """Queue a request from `prepare`: it gets its id and its samples' seeds here, in the order
        requests are added, so a seedless request's samples depend only on that order."""
        assert not req.request_id, "a prepared request is added once"
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        base = req.params.seed
        req.seeds = [base + i if base is not None else self._rng.getrandbits(62) for i in range(req.params.n)]
        req.seeds += [0] * req.params.n_greedy  # greedy continuations draw no noise
        for seq, seed in zip(req.seqs, req.seeds):
            seq.seed = seed
        req.request_id, req.arrival = rid, time.monotonic()
        self.scheduler.add(req)  # raises ValueError for requests that can never run
        self.requests[rid] = req
        return rid

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    keep_vision: bool = False) -> str:
        """Queue a prompt (`prepare` + `add`); keep_vision: see `prepare`."""
        return self.add(self.prepare(prompt, params, keep_vision=keep_vision), request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; returns its partial output (None if unknown or already returned)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if not req.finished:
            self.scheduler.abort(req)
        self._failed.pop(request_id, None)
        return self._safe_output(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one prefill or decode batch; return the requests that finished.

        With `overlap_schedule`, a decode step is launched before the previous one's tokens are
        applied on the host (they feed the new step on the device), then the previous one is
        resolved while the GPU runs: requests finish one call later, with the same outputs."""
        if self.memory is not None and self.memory.state["kv_cache"] != "resident":
            raise RuntimeError("the engine's KV cache is released (the memory manager is outside the rollout "
                               "phase): enter the rollout phase before generating")
        spec = self.spec is not None and self.spec.active(len(self.scheduler.running), len(self.scheduler.waiting))
        if self._inflight is not None and (self.scheduler.waiting or spec):
            # prefill (or a preempted re-entry) needs every token known; so does drafting
            touched = self._resolve()
            self._last_end = None
            return self._outputs(touched)
        # a sequence whose in-flight token is its last (by length) does not decode again
        hold = frozenset(s for s in self.scheduler.running if s.pending and self._length_done(s, len(s)))
        batch = self.scheduler.schedule(hold)
        if batch.is_prefill:
            self._prefill(batch.prefill)
            touched = [s for item in batch.prefill for s in (item.seq, *item.forks)]
            self._last_end = None  # the next decode step does not follow a decode step: no period
        elif batch.decode and spec:
            touched = self._speculate(batch.decode)
        elif batch.decode:
            launched = self._launch_decode(batch.decode)  # None: every sequence's request was dropped
            ahead = 0.0
            if self.spec is not None:  # drafting's counts, in half the time the host would wait
                t = time.perf_counter()
                self.spec.prepare(batch.decode, self._idle_ms / 2)
                ahead = (time.perf_counter() - t) * 1e3
            touched = self._resolve()  # the previous step, while this one runs
            if self.spec is not None:  # backed off: drafts scored against what this loop draws (no GPU work)
                self.spec.shadow(batch.decode, self.requests)
            self._idle_ms += ahead
            self._inflight = launched
            if not self.cfg.overlap_schedule:
                touched += self._resolve()
        elif self._inflight is not None:
            touched = self._resolve()
            self._last_end = None  # nothing follows it now: the next step may come after an idle gap
        else:
            if self.scheduler.has_work:
                raise RuntimeError("scheduler made no progress (KV cache too small for the waiting work)")
            return []
        return self._outputs(touched)

    def _outputs(self, touched: list[Sequence]) -> list[RequestOutput]:
        done = {id(s.request): s.request for s in touched
                if s.finished and s.request.finished and s.request.request_id in self.requests
                and s.request.request_id not in self._failed}
        outs = [self._safe_output(r) for r in done.values()]
        for rid, error in self._failed.items():
            req = self.requests.get(rid)
            if req is not None:
                self.requests.pop(rid)
                outs.append(RequestOutput(rid, list(req.inputs.input_ids), [
                    SampleOutput(s.output_ids, s.logprobs, "abort") for s in req.seqs], error=error))
        self._failed.clear()
        return outs

    # ---- isolation: one request's failure is its own ------------------------------------------------
    def _drop(self, req: Request, error: Exception) -> None:
        """Abort a request whose own work failed; `step` returns it with `error` (the first one)."""
        if req.request_id in self._failed or req.request_id not in self.requests:
            return
        if not req.finished:
            self.scheduler.abort(req)
        self._failed[req.request_id] = error

    def _safe_output(self, req: Request) -> RequestOutput:
        try:
            return self._output(req)
        except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error on this request's tokens
            self.requests.pop(req.request_id, None)
            return RequestOutput(req.request_id, list(req.inputs.input_ids),
                                 [SampleOutput(s.output_ids, s.logprobs, "abort") for s in req.seqs], error=e)

    def _sampling_tensors(self, seqs: list[Sequence], vocab: int,
                          device) -> tuple[list[Sequence], SamplingTensors | None]:
        """(sequences, their sampling tensors); on a failure, the requests whose own row fails are dropped
        and the rest built again (None: nothing left)."""
        try:
            return seqs, SamplingTensors.build([self._row(s) for s in seqs], vocab, device)
        except Exception:  # noqa: BLE001 - find whose row it is, on the host (cheap: only on this path)
            keep = []
            for s in seqs:
                try:
                    SamplingTensors.build([self._row(s)], vocab, "cpu")
                    keep.append(s)
                except Exception as e:  # noqa: BLE001
                    self._drop(s.request, e)
            keep = [s for s in keep if not s.request.finished]
            if len(keep) == len(seqs):
                raise  # no single request owns it
            if not keep:
                return [], None
            return keep, SamplingTensors.build([self._row(s) for s in keep], vocab, device)

    def _length_done(self, seq: Sequence, length: int) -> bool:
        """Whether a sequence of `length` tokens has reached max_new_tokens (its sample's own cap, when the
        request gives one) or max_model_len."""
        caps = seq.request.params.sample_max_new_tokens
        if caps is not None and seq.sample_index < len(caps):
            if length >= seq.num_prompt_tokens + caps[seq.sample_index]:
                return True
        return length >= seq.request.max_len

    def _row(self, seq: Sequence) -> tuple:
        p = seq.request.params
        if seq.sample_index >= p.n:  # a greedy continuation (n_greedy)
            return (0.0, -1, 1.0, 0.0, seq.seed, seq.num_output_tokens)
        return (p.temperature, p.top_k, p.top_p, p.min_p, seq.seed, seq.num_output_tokens)

    def _prefill(self, items) -> None:
        """Prefill a batch; when it fails, each request alone, dropping those that fail by themselves
        (prefill writes only its own cache slots, so running it again is safe)."""
        try:
            self._prefill_batch(items)
        except Exception as e:  # noqa: BLE001
            if len(items) > 1:
                for item in items:
                    self._prefill([item])
            else:
                self._drop(items[0].seq.request, e)

    def _prefill_batch(self, items) -> None:
        inputs, slots, rows, owners = [], [], [], []
        for item in items:
            seq, req = item.seq, item.seq.request
            inputs.append(req.inputs.with_response(seq.output_ids))  # a re-prefill recomputes its outputs too
            slots.append([self.blocks.slot(seq, i) for i in range(len(seq))])
            start = req.params.logprob_start_len
            fresh = seq.num_output_tokens == 0 and req.input_logprobs is None
            # logits row i predicts token i + 1; token `start` needs row start - 1 (token 0 has none)
            rows.append((max(start - 1, 0), len(seq) - 1) if fresh and 0 <= start < len(seq) else None)
            owners.append([seq, *item.forks])
        last, extra, visual = self.runner.prefill(inputs, slots, rows)
        self.runner.copy_blocks([c for item in items for c in item.copies])
        for item, vis in zip(items, visual):
            if item.seq.request.keep_vision and vis is not None:
                item.seq.request.vision_embeds = vis
        for h in self.hooks:
            if hasattr(h, "on_prefill"):
                h.on_prefill([item.seq.request for item in items])
        for item, r, ex in zip(items, rows, extra):
            if ex is not None:
                self._input_logprobs(item.seq, r, ex)
        index = torch.tensor([i for i, seqs in enumerate(owners) for _ in seqs], device=last.device)
        flat = [s for seqs in owners for s in seqs]
        self._sample_and_append(flat, last[index])

    def _input_logprobs(self, seq: Sequence, rows: tuple[int, int], logits: torch.Tensor) -> None:
        p = seq.request.params
        t = p.temperature if p.temperature > 0 else 1.0
        targets = torch.tensor(seq.token_ids[rows[0] + 1 : rows[1] + 1], device=logits.device)
        lp = torch.log_softmax(logits / t, -1).gather(-1, targets[:, None]).squeeze(-1).tolist()
        # entries for prompt tokens start .. L-1; the first prompt token has no logprob
        seq.request.input_logprobs = [None] + lp if p.logprob_start_len == 0 else lp

    def _launch_decode(self, seqs: list[Sequence]) -> _Inflight | None:
        """Queue one decode step on the device (graph replay + sampling + copies of the sampled tokens
        to pinned host memory); nothing here waits for the GPU."""
        info = None
        if self.hooks:
            info = DecodeStepInfo(self.decode_steps, len(seqs), self._last_step_ms,
                                  len(self.scheduler.waiting), self.stream, self._last_period_ms, self._last_forward,
                                  self._last_launch_ms)
            for h in self.hooks:
                h.on_decode_step(info)
        t0 = time.perf_counter()
        start = end = forward = None
        if self.stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if self.hooks:  # the forward's own GPU time, for hooks that tell device from host delays
                forward = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        # sampling parameters go up through fresh pinned buffers (as do the step's inputs in the runner):
        # a copy from pageable memory may make the host wait for the step still in flight
        seqs, st = self._sampling_tensors(seqs, self.model.cfg.text.vocab_size, self.runner.device)
        if st is None:
            return None
        prev = self._inflight
        src = None
        if prev is not None:  # input tokens of sequences in the step in flight come from its device output
            row = {id(s): i for i, s in enumerate(prev.seqs)}
            src = [row.get(id(s), -1) if s.pending else -1 for s in seqs]
        lens = [len(s) for s in seqs]
        logits = self.runner.decode(
            ids=[s.token_ids[-1] if not s.pending else 0 for s in seqs],
            positions=[n - 1 + s.request.rope_delta for s, n in zip(seqs, lens)],
            tables=[s.block_table for s in seqs],
            seq_lens=lens,
            slots=[self.blocks.slot(s, n - 1) for s, n in zip(seqs, lens)],
            prev_tokens=None if prev is None else prev.tokens,
            src=src,
            table_keys=[(s.seq_id, s.num_preemptions) for s in seqs],  # a re-prefilled sequence has a new table
            timing=forward,
        )
        tokens, logprobs = self.decode_sampler(logits, st)
        host = None
        if tokens.is_cuda:
            host = (torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True),
                    torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True))
            host[0].copy_(tokens, non_blocking=True)
            host[1].copy_(logprobs, non_blocking=True)
        if end is not None:
            end.record()
        for s in seqs:
            s.pending += 1
        if self.hooks:
            self._last_launch_ms = (time.perf_counter() - t0) * 1e3
        for h in self.hooks:  # the step is queued: work launched now runs beside it on the device
            if hasattr(h, "after_decode_launch"):
                h.after_decode_launch(info)
        self.decode_steps += 1
        return _Inflight(seqs, tokens, logprobs, host, start, end, t0, self.decode_steps - 1, forward)

    def _speculate(self, seqs: list[Sequence]) -> list[Sequence]:
        """One verification step in place of a decode step (speculative.py): draft, score every
        sequence's last token + draft in one pass, keep what the rule accepts, roll back the rest.
        Synchronous: the next step drafts from the tokens this one keeps."""
        info = None
        if self.hooks:
            info = DecodeStepInfo(self.decode_steps, len(seqs), self._last_step_ms, len(self.scheduler.waiting),
                                  self.stream, None)
            for h in self.hooks:
                h.on_decode_step(info)
        t0 = time.perf_counter()
        drafts = self.spec.drafts(seqs, self.requests)
        for s, d in zip(seqs, drafts):
            if d and not self.blocks.reserve(s, len(s) + len(d)):
                d.clear()  # no room for the draft's K/V: this sequence decodes one token
        vocab = self.model.cfg.text.vocab_size

        def rows():  # each sequence's sampling row, for each of its draft positions
            out = []
            for s, d in zip(seqs, drafts):
                *head, step = self._row(s)
                out += [(*head, step + j) for j in range(len(d) + 1)]
            return out

        try:
            st = SamplingTensors.build(rows(), vocab, self.runner.device)
        except Exception:  # noqa: BLE001 - find whose row fails (their requests are dropped), go on without them
            keep, _ = self._sampling_tensors(seqs, vocab, "cpu")
            drafts = [d for s, d in zip(seqs, drafts) if s in keep]
            seqs = keep
            if not seqs:
                return []
            st = SamplingTensors.build(rows(), vocab, self.runner.device)
        ids, positions, seq_lens, slots = [], [], [], []
        for s, d in zip(seqs, drafts):
            n = len(s)
            for j, tok in enumerate([s.token_ids[-1], *d]):
                ids.append(tok)
                positions.append(n - 1 + j + s.request.rope_delta)
                seq_lens.append(n + j)
                slots.append(self.blocks.slot(s, n - 1 + j))
        timing = self._verify_events
        tv = time.perf_counter()
        logits = self.runner.verify(ids, positions, [s.block_table for s in seqs], seq_lens, slots,
                                    [len(d) + 1 for d in drafts], timing=timing)
        forward_ms = (time.perf_counter() - tv) * 1e3  # on CPU the pass ran in the call
        self.spec.index(seqs)  # host work while the pass runs: the next drafts' counts
        for h in self.hooks:
            if hasattr(h, "after_decode_launch"):
                h.after_decode_launch(info)
        results = self.spec.rule(self.sampler, logits, st, drafts)
        self.spec.count(drafts, [len(toks) for toks, _ in results])
        for seq, (toks, lps) in zip(seqs, results):
            for tok, lp in zip(toks, lps):
                if seq.finished:  # stopped by an earlier kept token (or its request was dropped)
                    break
                self._append(seq, tok, lp)
            if not seq.finished:
                self.blocks.trim(seq, len(seq))  # the rejected tokens' blocks
        self._last_step_ms = (time.perf_counter() - t0) * 1e3
        self._last_period_ms, self._last_end = None, None
        # the rule read the tokens on the host: the pass's end event has completed
        self.spec.stats.forward_ms += timing[0].elapsed_time(timing[1]) if timing is not None else forward_ms
        self.spec.stats.wall_ms += self._last_step_ms
        if self.cfg.speculative_adaptive:
            self.spec.note_step(self._last_step_ms, verify=True)
        self.decode_steps += 1
        return seqs

    def _resolve(self) -> list[Sequence]:
        """Apply the tokens of the step in flight (waits for that step only); returns its sequences."""
        inf, self._inflight = self._inflight, None
        self._idle_ms = 0.0
        if inf is None:
            return []
        if inf.end is not None:
            if self.spec is None:
                inf.end.synchronize()
            else:  # how long the host waits: speculation counts drafts ahead in a share of it
                t = time.perf_counter()
                inf.end.synchronize()
                self._idle_ms = (time.perf_counter() - t) * 1e3
            self._last_step_ms = inf.start.elapsed_time(inf.end)
            prev, self._last_end = self._last_end, (inf.step, inf.end)
            # end-to-end time from the previous step: also counts gaps where the device waited for the host
            self._last_period_ms = prev[1].elapsed_time(inf.end) if prev and prev[0] == inf.step - 1 else None
            if inf.forward is not None:
                self._last_forward = (inf.step, inf.forward[0].elapsed_time(inf.forward[1]))
            tokens, logprobs = inf.host[0].tolist(), inf.host[1].tolist()
        else:
            tokens, logprobs = inf.tokens.tolist(), inf.logprobs.tolist()
            end = time.perf_counter()
            self._last_step_ms = (end - inf.t0) * 1e3
            prev, self._last_end = self._last_end, (inf.step, end)
            self._last_period_ms = (end - prev[1]) * 1e3 if prev and prev[0] == inf.step - 1 else None
        if self.spec is not None and self.cfg.speculative_adaptive:  # in the tail: what a decode step costs there
            self.spec.note_step(self._last_period_ms, verify=False)
        for seq, tok, lp in zip(inf.seqs, tokens, logprobs):
            seq.pending -= 1
            if seq.finished:  # stopped by an earlier token (or aborted): this one is discarded
                continue
            self._append(seq, tok, lp)
        return inf.seqs

    def _append(self, seq: Sequence, tok: int, lp: float) -> None:
        """One sampled token onto its sequence, then the stop checks (a failing check drops that request alone)."""
        seq.token_ids.append(tok)
        seq.logprobs.append(lp)
        try:
            self._check_finish(seq, tok)
        except Exception as e:  # noqa: BLE001 - this request's stop check: it alone is dropped
            self._drop(seq.request, e)

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor, st: SamplingTensors | None = None) -> None:
        if st is None:
            st = SamplingTensors.build([self._row(s) for s in seqs], logits.shape[-1], logits.device)
        tokens, logprobs = self.sampler(logits, st)
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            if not seq.finished:  # else its request was dropped by a fork's failed stop check
                self._append(seq, tok, lp)

    def _check_finish(self, seq: Sequence, tok: int) -> None:
        p = seq.request.params
        reason, matched = None, None
        if tok in p.stop_token_ids:
            reason, matched = "stop", tok
        elif tok == self.eos_token_id and not p.ignore_eos:
            reason, matched = "stop", tok
        elif p.stop and self.processor is not None:
            tail = self.processor.decode(seq.output_ids[-(max(len(s) for s in p.stop) + 8) :],
                                         skip_special_tokens=False)
            matched = next((s for s in p.stop if s in tail), None)
            reason = "stop" if matched else None
        if reason is None and self._length_done(seq, len(seq.token_ids)):  # resolved tokens only
            reason = "length"
        if reason:
            seq.matched_stop = matched
            self.scheduler.finish(seq, reason)

    def _output(self, req: Request) -> RequestOutput:
        samples = []
        for s in req.seqs:  # the n samples, then the greedy continuations
            text = None
            if self.processor is not None:
                text = self.processor.decode(s.output_ids, skip_special_tokens=req.params.skip_special_tokens)
                if isinstance(s.matched_stop, str) and s.matched_stop in text:
                    text = text[: text.index(s.matched_stop)]
            samples.append(SampleOutput(s.output_ids, s.logprobs, s.finish_reason, s.matched_stop, text))
        self.requests.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.finish(req)
        n = req.params.n
        return RequestOutput(req.request_id, list(req.inputs.input_ids), samples[:n], req.input_logprobs,
                             {"num_preemptions": sum(s.num_preemptions for s in req.seqs)}, req.vision_embeds,
                             greedy=samples[n:])

    # ---- batch API ----------------------------------------------------------------------------
    def generate(self, prompts: Seq, params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, keep_vision: bool = False, on_output=None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (keep_vision: see add_request).
        on_output(i, output): called from this loop as prompt i's request (all its n samples) finishes,
        in finishing order, before the next engine step: a consumer can start on a group at once.
        Each output's meta["finish_index"] is its place in that order (0: the first to finish)."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("one SamplingParams per prompt (or one for all)")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp, keep_vision=keep_vision))
        except ValueError:
            for rid in ids:
                self.abort(rid)
            raise
        outputs: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="rollout", unit="req")
        index = {rid: i for i, rid in enumerate(ids)}
        while len(outputs) < len(ids):
            for out in self.step():
                if out.error is not None:  # a prompt failed: so does the batch
                    for rid in ids:
                        self.abort(rid)
                    raise out.error
                out.meta["finish_index"] = len(outputs)
                outputs[out.request_id] = out
                if on_output is not None:
                    on_output(index[out.request_id], out)
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [outputs[i] for i in ids]


@dataclass
class _Inflight:
    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] on the device
    logprobs: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor] | None  # pinned copies (GPU), filled when `end` completes
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    t0: float
    step: int
    forward: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # around the forward alone (hooks on)
