"""The engine thread: the only thread that touches the engine, the model, the trainer and the engine's
tokenizer.

The engine is not thread-safe, so every HTTP handler talks to it through this worker:

    loop:  apply aborts -> run queued jobs (in order) -> engine.step() if it has work -> deliver events
    jobs:  plain jobs run between two engine steps (admitting prepared requests, ledgers, checksums);
           `drain` jobs (train step, save, load) wait until the in-flight requests have finished and
           hold back everything queued after them, so weights never change under a running request
           and a rollout queued behind a train step samples from the updated policy.

Requests from all handlers share one continuous batch: every job queued while a step runs is run
before the next one, so requests that arrive while the engine is busy join the batch at the next
step and are prefilled together. Handlers prepare (encode, validate) their requests before they
queue them (inflight.py), so the only per-request work here is queueing a ready request.

Each engine request has a `Ticket`. Events go onto the ticket's asyncio queue, delivered once per
loop iteration with one `call_soon_threadsafe` per event loop (not one per event):

    ("update", ticket, sample_index, token_ids, logprobs, text)   streaming tickets, after a step that
                                                                  grew the sample, unless its last
                                                                  update is still unread (whole output
                                                                  so far: a newer one replaces it)
    ("done", ticket, RequestOutput, extra)                        extra = ticket.finalize(output)
    ("error", ticket, exception)                                  the engine step (or admission) failed

An abort (client gone) removes the request from the engine at the next iteration; a ticket aborted
before its request was added is simply never added. A request that fails on its own inside a step
(the engine drops it and returns it with `error`) fails its ticket alone; the others run on as if it
had never been there. An exception out of `engine.step()` itself (no single request owns it) fails
the in-flight tickets (500) and aborts their requests; the thread keeps serving.

Without an engine (`engine=None`: the rollouts run on a backend outside this loop, SGLang) the worker
runs jobs only, in order, on the one thread that touches the model and the trainer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rollplex.server")

@dataclass(eq=False)
class Ticket:
    """One engine request as seen by an HTTP handler."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int = 0  # position in the HTTP request (batch index)
    stream: bool = False
    finalize: Callable[[Any], Any] | None = None  # runs in the worker on the final output
    rid: str | None = None
    prompt_tokens: int = 0
    weights_version: int = -1  # the weights the request samples from (set when it is added)
    done: bool = False
    cancelled: bool = False
    sent: list[int] = field(default_factory=list)  # streaming: tokens published per sample
    # streaming: samples whose last update the handler has not taken yet. An update carries the whole
    # output so far, so a newer one replaces it losslessly: while one waits, none is added, and a
    # handler that falls behind (many streams, one event loop) gets fewer, larger chunks instead of
    # a backlog that the engine thread built and serialised token by token.
    unread: set[int] = field(default_factory=set)
    watch: asyncio.Task | None = None  # the first ticket of an HTTP request: its disconnect watcher


@dataclass
class _Job:
    fn: Callable[[], Any]
    drain: bool
    future: concurrent.futures.Future


def _deliver(events: list) -> None:
    for queue, event in events:
        queue.put_nowait(event)


class EngineWorker:
    def __init__(self, engine, decode: Callable[[list[int], bool], str] | None = None, name: str = "rollplex-engine",
                 before_step: Callable[[], None] | None = None):
        """before_step: runs on this thread before each engine step (the server puts the memory manager in
        its rollout phase there)."""
        self.engine, self.decode, self.before_step = engine, decode, before_step
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._aborts: deque[Ticket] = deque()
        self._tickets: dict[str, Ticket] = {}
        self._streams: dict[str, Ticket] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}
        self._closed = False
        self.busy_job = False  # a job is running right now (for /health)
        self.num_aborted = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- called from any thread -------------------------------------------------------------
    def call(self, fn: Callable[[], Any], drain: bool = False) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine worker is shut down")
            self._jobs.append(_Job(fn, drain, fut))
            self._cv.notify()
        return fut

    async def run(self, fn: Callable[[], Any], drain: bool = False) -> Any:
        return await asyncio.wrap_future(self.call(fn, drain))

    def abort(self, ticket: Ticket) -> None:
        with self._cv:
            self._aborts.append(ticket)
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)

    # ---- called inside a job (worker thread) ----------------------------------------------------
    def add(self, ticket: Ticket, request) -> str | None:
        """Queue a prepared engine request (`Engine.prepare`) for `ticket`; None if the ticket was
        aborted meanwhile."""
        if ticket.cancelled:
            return None
        rid = self.engine.add(request)
        ticket.rid, ticket.sent = rid, [0] * request.params.n
        self._tickets[rid] = ticket
        if ticket.stream:
            self._streams[rid] = ticket
        return rid

    def discard(self, tickets: list[Ticket]) -> None:
        """Drop requests added by a job that then failed (no events are emitted for them)."""
        for t in tickets:
            if t.rid is not None and self._tickets.pop(t.rid, None) is not None:
                self._streams.pop(t.rid, None)
                self.engine.abort(t.rid)

    def fail(self, tickets: list[Ticket], error: BaseException) -> None:
        """Answer these tickets with an error event (a job that admits requests failed)."""
        for t in tickets:
            t.done = True
            self._emit(t, "error", error)

    # ---- the thread ---------------------------------------------------------------------------
    @property
    def _engine_busy(self) -> bool:
        return self.engine is not None and self.engine.has_work

    def _next_job(self) -> _Job | None:
        with self._cv:
            if not self._jobs or (self._jobs[0].drain and self._engine_busy):
                return None
            return self._jobs.popleft()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._aborts or self._engine_busy
                           or (self._jobs and not (self._jobs[0].drain and self._engine_busy))):
                    self._cv.wait(timeout=1.0)
                if self._closed:
                    break
                aborts = list(self._aborts)
                self._aborts.clear()
            for t in aborts:
                self._abort(t)
            while (job := self._next_job()) is not None:
                self._run_job(job)
            if self._engine_busy:
                self._step()
            self._flush()
        for t in list(self._tickets.values()):
            self._emit(t, "error", RuntimeError("server shutting down"))
        self._flush()

    def _run_job(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        self.busy_job = True
        try:
            job.future.set_result(job.fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            job.future.set_exception(e)
        finally:
            self.busy_job = False

    def _abort(self, t: Ticket) -> None:
        t.cancelled = True
        if t.rid is None or t.done or t.rid not in self._tickets:
            return
        try:
            out = self.engine.abort(t.rid)
        except Exception:  # noqa: BLE001 - keep serving; the client is gone anyway
            log.exception("aborting request %s failed", t.rid)
            out = None
            self._tickets.pop(t.rid, None)
            self._streams.pop(t.rid, None)
        self.num_aborted += 1
        if out is not None:
            self._finish(out)

    def _step(self) -> None:
        try:
            if self.before_step is not None:
                self.before_step()
            outs = self.engine.step()
        except Exception as e:  # keep serving: fail what was in flight
            log.exception("engine step failed; aborting %d in-flight requests", len(self._tickets))
            for rid, t in list(self._tickets.items()):
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001
                    pass
                t.done = True
                self._emit(t, "error", e)
            self._tickets.clear()
            self._streams.clear()
            return
        for out in outs:
            self._finish(out)
        self._publish_streams()

    def _finish(self, out) -> None:
        t = self._tickets.pop(out.request_id, None)
        self._streams.pop(out.request_id, None)
        if t is None:
            return
        t.done = True
        if out.error is not None:
            log.error("request %s failed in the engine and was dropped (the others go on): %s: %s",
                      out.request_id, type(out.error).__name__, out.error)
            self._emit(t, "error", out.error)
            return
        extra = None
        if t.finalize is not None:
            try:
                extra = t.finalize(out)
            except Exception as e:  # noqa: BLE001
                self._emit(t, "error", e)
                return
        self._emit(t, "done", out, extra)

    def _publish_streams(self) -> None:
        for rid, t in self._streams.items():
            req = self.engine.requests.get(rid)
            if req is None:
                continue
            for j, seq in enumerate(req.seqs[: req.params.n]):  # the samples (not greedy continuations)
                ids = seq.output_ids
                if len(ids) > t.sent[j] and j not in t.unread:
                    t.sent[j] = len(ids)
                    t.unread.add(j)
                    text = self.decode(ids, req.params.skip_special_tokens) if self.decode is not None else None
                    self._emit(t, "update", j, list(ids), list(seq.logprobs), text)

    # ---- events and event loops ---------------------------------------------------------------
    def _emit(self, t: Ticket, kind: str, *rest) -> None:
        self._outbox.setdefault(t.loop, []).append((t.queue, (kind, t, *rest)))

    def _flush(self) -> None:
        """Hand this iteration's events to their event loops: one wake-up per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, events in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
                pass
