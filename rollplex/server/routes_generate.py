"""POST /generate: SGLang's request/response schema over the shared continuous batch (see sglang.py).

The batch size, each prompt's length, its stop conditions, the rid and the number of samples are
checked before anything is tokenised (limits.py), and `image_data` is read and decoded under the
server's media policy on an intake thread (media.py). The body is decoded off the event loop (body.py).

Served by the native engine only: with another rollout backend (`--rollout-backend sglang`), or by a
tensor-parallel process group (`--tensor-parallel` > 1 under torchrun), it is a 400.

Non-streaming: wait for every prompt, answer a dict (one prompt, n = 1) or a prompt-major list,
serialised by one json.dumps (a JSONResponse returned as is: FastAPI's jsonable_encoder would walk every
token id in Python on the event loop first, ~10x the dump's time).
Streaming (`stream: true`): Server-Sent Events, `data: {chunk}\\n\\n` per new token batch of a
sample (cumulative text / output_ids, `index` = prompt-major sample position), a final chunk per
sample with its finish_reason, then `data: [DONE]\\n\\n`. A client that disconnects (streaming or
not) has its unfinished requests aborted in the engine.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import limits, sglang
from .body import JSONOffLoop
from .errors import bad_request
from .inflight import ClientGone, abort_unfinished, collect, next_event, release, submit
from .schemas import GenerateRequest


def _finalizer(state, spec):
    """Token texts for return_text_in_logprobs, computed on the engine thread (the tokenizer's)."""
    def fin(out):
        start = spec.params.logprob_start_len
        return {"out": [state.token_texts(s.token_ids) for s in out.samples],
                "in": state.token_texts(out.prompt_token_ids[start:]) if start >= 0 else None}
    return fin


def router(state) -> APIRouter:
    r = APIRouter(route_class=JSONOffLoop)
    defaults = {"max_new_tokens": state.cfg.rl.max_new_tokens}

    def sample_items(spec, t, out, extra, latency) -> list[dict]:
        items = []
        base = spec.rid or t.rid
        n = len(out.samples)
        in_lp = sglang.input_logprobs(out, spec.params.logprob_start_len, extra and extra["in"]) \
            if spec.return_logprob else None
        for j, s in enumerate(out.samples):
            reason = sglang.finish_reason(s.finish_reason, s.matched_stop, len(s.token_ids))
            items.append(sglang.sample_dict(
                sglang.sample_id(base, n, j), len(out.prompt_token_ids), s.token_ids, s.logprobs, s.text,
                reason, spec.return_logprob, extra and extra["out"][j], in_lp, latency))
        return items

    @r.post("/generate")
    async def generate(req: GenerateRequest, request: Request):
        if state.engine is None:
            raise bad_request(f"/generate is served from the native engine's loop; this server's rollouts run on "
                              f"{state.rl.rollout_backend} (--rollout-backend): use /rollout with for_training false")
        if state.engine.tp is not None:
            raise bad_request("/generate is not served by a tensor-parallel group: its continuous batching steps rank "
                              "0's engine alone, and every rank's shard must run each step; use /rollout (with "
                              "for_training false for evaluation), which every rank decodes together")
        t0 = time.perf_counter()
        check_sizes(state, req)
        specs, batched = sglang.expand(req, defaults, state.cfg.engine.max_num_seqs, state.cfg.limits)
        fins = [_finalizer(state, s) if (req.return_text_in_logprobs and s.return_logprob) else None for s in specs]
        pixels = state.media.request()  # one decode budget for the request's images (media.py)
        encoders = [(lambda p=s.prompt: state.encode_generate(p, pixels)) for s in specs]
        try:
            tickets, _ = await submit(state, encoders, [s.params for s in specs], stream=req.stream, finalize=fins,
                                      inline=req.input_ids is not None, request=request)
        except ClientGone:
            return Response(status_code=499)
        offsets = [0]
        for s in specs:
            offsets.append(offsets[-1] + s.params.n)
        if req.stream:
            return StreamingResponse(_stream(state, specs, tickets, offsets, request, sample_items, t0),
                                     media_type="text/event-stream")
        try:
            results = await collect(state, tickets, request)
        except ClientGone:
            return Response(status_code=499)
        latency = time.perf_counter() - t0
        items = [it for i, spec in enumerate(specs) for it in sample_items(spec, tickets[i], *results[i], latency)]
        return JSONResponse(items[0] if not batched and len(items) == 1 else items)

    return r


def check_sizes(state, req: GenerateRequest) -> None:
    """400 for a batch with too many prompts or a prompt too long to tokenise (limits.py), before any work."""
    max_len = state.cfg.engine.max_model_len
    prompts = req.text if req.text is not None else req.input_ids
    batch = prompts if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else [prompts]
    try:
        limits.check_count(state.cfg.limits, len(batch), "prompts")
        for i, p in enumerate(batch):
            if isinstance(p, str):
                limits.check_text(state.cfg.limits, max_len, len(p), f"prompt[{i}]")
            else:
                limits.check_ids(max_len, len(p), f"prompt[{i}]")
    except ValueError as e:
        raise bad_request(str(e)) from None


async def _stream(state, specs, tickets, offsets, request, sample_items, t0):
    finished: dict[int, bool] = {}
    try:
        while len(finished) < len(tickets):
            kind, t, *rest = await next_event(tickets, request)
            spec = specs[t.index]
            if kind == "error":
                err = {"error": {"code": 500, "message": f"engine error: {rest[0]}"}}
                yield f"data: {json.dumps(err)}\n\n"
                return
            if kind == "update":
                j, ids, lps, text = rest
                t.unread.discard(j)  # the engine thread may publish this sample's next update
                chunk = sglang.sample_dict(sglang.sample_id(spec.rid or t.rid, spec.params.n, j), t.prompt_tokens,
                                           ids, lps, text, None, spec.return_logprob)
                chunk["index"] = offsets[t.index] + j
                yield f"data: {json.dumps(chunk)}\n\n"
            elif kind == "done":
                finished[t.index] = True
                out, extra = rest
                state.metrics.inc("rollplex_prompt_tokens_total", len(out.prompt_token_ids))
                state.metrics.inc("rollplex_generation_tokens_total", sum(len(s.token_ids) for s in out.samples))
                for j, item in enumerate(sample_items(spec, t, out, extra, time.perf_counter() - t0)):
                    item["index"] = offsets[t.index] + j
                    yield f"data: {json.dumps(item)}\n\n"
        yield "data: [DONE]\n\n"
    except ClientGone:
        pass
    finally:
        release(tickets)
        abort_unfinished(state, tickets, finished)
