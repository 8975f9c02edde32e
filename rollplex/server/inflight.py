"""The async side of engine requests: submit prompts as tickets, wait for them, abort on disconnect.

    tickets = await submit(state, encode_fns, params, stream=...)   # HTTP 400 if any prompt is bad
    results = await collect(state, tickets, request)                # {index: (RequestOutput, extra)}

`submit` runs one worker job that encodes every prompt and adds its engine request; if one prompt
is bad (undecodable image, too long, placeholder mismatch, prompt + max_new_tokens over
max_model_len) the ones already added are dropped and the whole request fails with 400 — nothing
half-done stays in the engine. `collect` polls for a client disconnect while waiting and aborts the
request's unfinished tickets when the client is gone. Each ticket records the weights version its
request samples from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import HTTPException, Request

from .errors import bad_request
from .worker import Ticket

PLACEHOLDER_HINT = " (text prompts need one <|vision_start|><|image_pad|><|vision_end|> per image)"


class ClientGone(Exception):
    """The HTTP client disconnected while its requests were running (they were aborted)."""


async def submit(state, encoders: list[Callable[[], object]], params: list, stream: bool = False,
                 finalize: list | None = None, what: str = "prompt") -> tuple[list[Ticket], list]:
    """Encode and add one engine request per prompt; returns (tickets, encoded inputs)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    tickets = [Ticket(queue, loop, index=i, stream=stream, finalize=(finalize or [None] * len(params))[i])
               for i in range(len(params))]
    worker, max_len = state.worker, state.cfg.engine.max_model_len

    def job():
        added, inputs = [], []
        try:
            for i, (enc, t, sp) in enumerate(zip(encoders, tickets, params)):
                try:
                    x = enc()
                except Exception as e:  # processor / image errors: the client's input
                    hint = PLACEHOLDER_HINT if "placeholder" in str(e) else ""
                    raise ValueError(f"{what}[{i}]: {e}{hint}") from e
                check_length(len(x.input_ids), sp.max_new_tokens, max_len, f"{what}[{i}]")
                try:
                    worker.add(t, x, sp)
                except ValueError as e:
                    raise ValueError(f"{what}[{i}]: {e}") from e
                t.prompt_tokens = len(x.input_ids)
                # read on the engine thread: weights change only in drain jobs, which wait for this request
                t.weights_version = state.weights_version
                added.append(t)
                inputs.append(x)
        except BaseException:
            worker.discard(added)
            raise
        return inputs

    try:
        inputs = await worker.run(job)
    except ValueError as e:
        raise bad_request(str(e)) from None
    return tickets, inputs


def check_length(prompt_tokens: int, max_new_tokens: int, max_model_len: int, where: str) -> None:
    """ValueError when the prompt plus max_new_tokens does not fit max_model_len (SGLang rejects such
    requests rather than cutting the answer short without saying so)."""
    if prompt_tokens < max_model_len and prompt_tokens + max_new_tokens > max_model_len:
        raise ValueError(f"{where}: {prompt_tokens} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                         f"max_model_len={max_model_len}; ask for at most {max_model_len - prompt_tokens} new "
                         "tokens or start the server with a larger --max-model-len")


def abort_unfinished(state, tickets: list[Ticket], finished) -> None:
    for t in tickets:
        if t.index not in finished:
            state.worker.abort(t)


async def next_event(tickets: list[Ticket], request: Request | None, poll_s: float = 0.25):
    """The next event of this request's tickets; ClientGone if the client disconnected meanwhile."""
    queue = tickets[0].queue
    while True:
        try:
            return await asyncio.wait_for(queue.get(), poll_s)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                raise ClientGone() from None


async def collect(state, tickets: list[Ticket], request: Request | None) -> dict[int, tuple]:
    results: dict[int, tuple] = {}
    try:
        while len(results) < len(tickets):
            kind, t, *rest = await next_event(tickets, request)
            if kind == "error":
                raise HTTPException(500, f"engine error: {type(rest[0]).__name__}: {rest[0]}")
            if kind == "done":
                results[t.index] = tuple(rest)
    except BaseException:
        abort_unfinished(state, tickets, results)
        raise
    for out, _ in results.values():
        state.metrics.inc("rollplex_prompt_tokens_total", len(out.prompt_token_ids))
        state.metrics.inc("rollplex_generation_tokens_total", sum(len(s.token_ids) for s in out.samples))
    return results
