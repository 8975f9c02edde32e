"""The async side of engine requests: submit prompts as tickets, wait for them, abort on disconnect.

    tickets, inputs = await submit(state, encoders, params, stream=...)   # HTTP 400 if any prompt is bad
    results = await collect(state, tickets, request)                      # {index: (RequestOutput, extra)}

`submit` prepares every prompt of the HTTP request off the engine thread: encoders run on the
server's intake threads, each with its own processor, one prompt at a time and round-robin between
HTTP requests (intake.py), so a heavy request (long prompts, large images) cannot keep the threads
from other requests' prompts (token-id prompts, which need no processor, are prepared right here),
and `Engine.prepare` validates each result. A client that disconnects while its prompts are prepared
gets ClientGone (499) and its prompts not started yet are never prepared. If one prompt is bad
(undecodable image, too long, placeholder mismatch, prompt + max_new_tokens over max_model_len) the
whole request fails with 400 and nothing reaches the engine. The prepared requests are then queued
as one worker job, which adds them between two engine steps and records the weights version they
sample from; `submit` does not wait for it (a failing job answers the tickets with an error).

`collect` waits for the tickets' events; a task watching the connection (the ASGI `receive`
channel, which reports `http.disconnect` when the client goes) ends the wait with ClientGone and the
request's unfinished tickets are aborted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import HTTPException, Request

from .errors import bad_request
from .intake import FairIntake
from .worker import Ticket

PLACEHOLDER_HINT = " (text prompts need one <|vision_start|><|image_pad|><|vision_end|> per image)"
log = logging.getLogger("rollplex.server")


class ClientGone(Exception):
    """The HTTP client disconnected while its requests were running (they were aborted)."""


def fair_intake(state) -> FairIntake:
    """The server's intake threads as a fair queue (made on first use, on the event loop's thread)."""
    intake = getattr(state, "_fair_intake", None)
    if intake is None:
        intake = state._fair_intake = FairIntake(state.intake, state.cfg.intake_threads)
    return intake


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def submit(state, encoders: list[Callable[[], object]], params: list, stream: bool = False,
                 finalize: list | None = None, what: str = "prompt", inline: bool = False, keep_vision: bool = False,
                 request: Request | None = None) -> tuple[list[Ticket], list]:
    """Prepare and queue one engine request per prompt; returns (tickets, encoded inputs).

    encoders: one call per prompt returning its ModelInputs, run on the intake threads (they may use
    `state.intake_processor`, that thread's own); inline: run them on the event loop instead (token-id prompts: nothing
    to tokenize, a thread hop would cost more than the work); keep_vision: the outputs carry the
    prefill's vision encodings (a frozen-vision trainer reuses them); request: the HTTP request, watched
    for a disconnect while its prompts are prepared (ClientGone)."""
    engine, max_len = state.engine, state.cfg.engine.max_model_len

    def prepare(i: int):
        enc, sp = encoders[i], params[i]
        try:
            x = enc()
        except Exception as e:  # processor / image errors: the client's input
            hint = PLACEHOLDER_HINT if "placeholder" in str(e) else ""
            raise ValueError(f"{what}[{i}]: {e}{hint}") from e
        check_length(len(x.input_ids), sp.max_new_tokens, max_len, f"{what}[{i}]")
        try:
            return engine.prepare(x, sp, keep_vision=keep_vision)
        except ValueError as e:
            raise ValueError(f"{what}[{i}]: {e}") from e

    loop = asyncio.get_running_loop()
    try:
        if inline:
            requests = [prepare(i) for i in range(len(encoders))]
        else:
            requests = await prepared(state, [lambda i=i: prepare(i) for i in range(len(encoders))], request)
    except ValueError as e:
        raise bad_request(str(e)) from None
    queue: asyncio.Queue = asyncio.Queue()
    fins = finalize or [None] * len(requests)
    tickets = [Ticket(queue, loop, index=i, stream=stream, finalize=fins[i], prompt_tokens=r.num_prompt_tokens)
               for i, r in enumerate(requests)]
    worker = state.worker

    def admit() -> None:
        added = []
        try:
            for t, r in zip(tickets, requests):
                if worker.add(t, r) is not None:
                    # read on the engine thread: weights change only in drain jobs, which wait for this request
                    t.weights_version = state.weights_version
                    added.append(t)
        except Exception as e:  # noqa: BLE001 - prepared requests are valid: this is the server's fault
            log.exception("queueing %d prepared requests failed", len(tickets))
            worker.discard(added)
            worker.fail(tickets, e)

    worker.call(admit)
    return tickets, [r.inputs for r in requests]


async def prepared(state, tasks: list, request: Request | None) -> list:
    """The tasks' results from the server's fair intake threads; ClientGone (the rest cancelled) if the client
    leaves first."""
    batch = fair_intake(state).run(tasks)
    done = asyncio.wrap_future(batch.future)
    if request is None:
        return await done
    gone = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not done.done():
        batch.cancel()
        done.cancel()
        raise ClientGone()
    return done.result()


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


async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
    """Put ("gone",) on the queue when the client disconnects. Once the body is read, the ASGI receive
    channel has nothing more to say until then (the server answers http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    queue.put_nowait(("gone",))


def release(tickets: list[Ticket]) -> None:
    """Stop watching the connection of this HTTP request (its answer is complete or abandoned)."""
    if tickets and tickets[0].watch is not None:
        tickets[0].watch.cancel()
        tickets[0].watch = None


async def next_event(tickets: list[Ticket], request: Request | None):
    """The next event of this request's tickets; ClientGone if the client disconnected meanwhile."""
    queue = tickets[0].queue
    if request is not None and tickets[0].watch is None:
        tickets[0].watch = asyncio.create_task(_watch_disconnect(request, queue))
    event = await queue.get()
    if event[0] == "gone":
        raise ClientGone()
    return event


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
    finally:
        release(tickets)
    for out, _ in results.values():
        state.metrics.inc("rollplex_prompt_tokens_total", len(out.prompt_token_ids))
        state.metrics.inc("rollplex_generation_tokens_total", sum(len(s.token_ids) for s in out.samples))
    return results
