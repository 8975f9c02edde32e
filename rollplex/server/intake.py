"""Fair intake: the intake threads take one prompt at a time, round-robin over the HTTP requests waiting.

    batch = FairIntake(executor, threads).run([prepare_prompt_0, prepare_prompt_1, ...])
    results = await asyncio.wrap_future(batch.future)    # in prompt order, or the first exception
    batch.cancel()                                       # the client left: nothing more is started

Preparing a prompt (tokenising, decoding its images) is the server's costliest work before the engine.
Run as one job per HTTP request, four requests of heavy images would hold every intake thread and a
one-line prompt behind them would wait for all of it. Here a request's prompts are queued as tasks and
each free thread takes the next task of the request whose turn it is, then sends that request to the
back of the line: a request waits for at most one prompt of each request ahead of it (each bounded by
the media and text limits), a lone request still uses every idle thread, and a cancelled request's
prompts that have not started are never run.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class IntakeBatch:
    """One HTTP request's prompts. `future` gets the results in order, or the first exception."""

    def __init__(self, tasks: list[Callable[[], Any]]):
        self.tasks = deque(enumerate(tasks))
        self.results: list[Any] = [None] * len(tasks)
        self.running = 0
        self.error: BaseException | None = None
        self.cancelled = False
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._owner: FairIntake | None = None

    def cancel(self) -> None:
        """Start none of the prompts not started yet (the ones running finish; their results are dropped)."""
        if self._owner is not None:
            self._owner._cancel(self)


class FairIntake:
    def __init__(self, executor: concurrent.futures.Executor, threads: int):
        self._executor, self._threads = executor, threads
        self._lock = threading.Lock()
        self._turns: deque[IntakeBatch] = deque()  # requests with prompts not started yet, in turn order
        self._workers = 0

    def run(self, tasks: list[Callable[[], Any]]) -> IntakeBatch:
        batch = IntakeBatch(tasks)
        batch._owner = self
        if not tasks:
            batch.future.set_result([])
            return batch
        with self._lock:
            self._turns.append(batch)
            spawn = min(self._threads - self._workers, len(tasks))
            self._workers += spawn
        for _ in range(spawn):
            self._executor.submit(self._work)
        return batch

    def _cancel(self, batch: IntakeBatch) -> None:
        with self._lock:
            batch.cancelled = True
            batch.tasks.clear()
            if batch in self._turns:
                self._turns.remove(batch)
            self._settle(batch)

    def _next(self) -> tuple[IntakeBatch, int, Callable] | None:
        with self._lock:
            if not self._turns:
                self._workers -= 1
                return None
            batch = self._turns.popleft()
            i, fn = batch.tasks.popleft()
            if batch.tasks:
                self._turns.append(batch)  # the back of the line: every other request goes first
            batch.running += 1
            return batch, i, fn

    def _work(self) -> None:
        while (item := self._next()) is not None:
            batch, i, fn = item
            try:
                result, error = fn(), None
            except BaseException as e:  # noqa: BLE001 - handed to the request's future
                result, error = None, e
            with self._lock:
                batch.running -= 1
                batch.results[i] = result
                if error is not None and batch.error is None:
                    batch.error = error
                    batch.tasks.clear()  # the request fails: its other prompts are not worth preparing
                    if batch in self._turns:
                        self._turns.remove(batch)
                self._settle(batch)

    @staticmethod
    def _settle(batch: IntakeBatch) -> None:
        """Complete the batch's future once nothing of it runs or waits (called under the lock)."""
        if batch.running or batch.tasks or batch.future.done():
            return
        if batch.error is not None:
            batch.future.set_exception(batch.error)
        elif batch.cancelled:
            batch.future.cancel()
        else:
            batch.future.set_result(batch.results)
