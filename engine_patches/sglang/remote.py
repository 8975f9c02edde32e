"""SGLang's Engine in a process of its own, with its own PYTHONPATH, driven from the trainer's process.

SGLang pins its own libraries (sglang 0.5.17 needs transformers 5.12, which the trainer's environment may
not have), so the trainer cannot always import it. `RemoteEngine(pythonpath=DIR, hook_spec=..., **server_args)`
starts `python -m engine_patches.sglang.engine_process` with DIR first on its PYTHONPATH; that process
builds engine.RollplexEngine (SGLang's Engine with the hooked scheduler) and answers over a local socket.
RemoteEngine takes the calls the rollout backend, the memory adapter and the hook control make on an
in-process engine:

    generate(**kw)                           Engine.generate there; answers back by value
    generate_groups(kw, starts)              the rollout's batch requests, one per prompt, each answer
                                             yielded as it arrives (groups.iter_groups there); closing the
                                             generator early cancels the rest
    release_memory_occupation(tags) / resume_memory_occupation(tags)
    update_weights_from_tensor(named_tensors, load_format, flush_cache)
                                             the tensors are serialized HERE, one payload per TP rank, in
                                             SGLang's wire form (a ForkingPickler dump: CUDA tensors as IPC
                                             handles, tensor_ipc.dumps), so the scheduler maps the trainer's
                                             memory directly; the engine process only forwards the bytes
    call(op, **params), collective_rpc(...)  the hook's control ops (engine.HookControl's methods on top)
    shutdown()
    version, tp_size                         the engine process's SGLang version and TP size

Messages cross the socket as tensor_ipc dumps (CPU tensors by value, CUDA tensors by IPC handle): the
prompts' pixel values are on the host already (outputs.image_item). An error in the engine process comes
back as the same exception type for ValueError / TypeError / NotImplementedError, else a RuntimeError,
with its traceback's tail in the message. If the engine process dies, every call says so with its exit
code.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Client
from pathlib import Path
from typing import Any

from . import tensor_ipc
from .engine import HookControl
from .spec import HookSpec

ROOT = Path(__file__).resolve().parents[2]  # the checkout: engine_patches and rollplex import from it
AUTHKEY_ENV = "ROLLPLEX_ENGINE_AUTHKEY"
PASSED = (ValueError, TypeError, NotImplementedError)


def child_env(pythonpath: str | None) -> dict:
    """The engine process's environment: `pythonpath` (SGLang's), then the checkout, then ours."""
    env = dict(os.environ)
    parts = [p for p in (pythonpath, str(ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def send(conn, msg) -> None:
    conn.send_bytes(tensor_ipc.dumps(msg))


def recv(conn):
    return tensor_ipc.loads(conn.recv_bytes())


class RemoteEngine(HookControl):
    def __init__(self, hook_spec: HookSpec | None = None, pythonpath: str | None = None, python: str | None = None,
                 start_timeout: float = 900.0, **server_args):
        if hook_spec is not None and not isinstance(hook_spec, HookSpec):
            raise ValueError("hook_spec must be a HookSpec")
        self.rollplex_dir = tempfile.mkdtemp(prefix="rollplex-sglang-")
        self._calls = itertools.count()
        self._lock = threading.RLock()
        self.conn = None
        address = os.path.join(self.rollplex_dir, "engine.sock")
        key = os.urandom(32)
        env = child_env(pythonpath)
        env[AUTHKEY_ENV] = key.hex()
        self.proc = subprocess.Popen([python or sys.executable, "-m", "engine_patches.sglang.engine_process", address],
                                     env=env, cwd=str(ROOT))
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.rollplex_dir)
        try:
            self.conn = self._connect(address, key, start_timeout)
            send(self.conn, ("start", hook_spec, server_args))
            info = self._result(self._recv(start_timeout), "start")
        except BaseException:
            self._finalizer()
            raise
        self.version, self.tp_size = info["version"], int(info["tp_size"])
        self.server_args = dict(server_args)

    # ---- the socket -------------------------------------------------------------------------------
    def _connect(self, address: str, key: bytes, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang engine process exited with code {self.proc.returncode} before it "
                                   "listened (its output above says why)")
            if os.path.exists(address):
                try:
                    return Client(address, family="AF_UNIX", authkey=key)
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the SGLang engine process did not listen within {timeout:.0f}s")
            time.sleep(0.05)

    def _recv(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the SGLang engine process exited with code {self.proc.returncode} "
                                   "(its output above says why)")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the SGLang engine process within {timeout:.0f}s")
        return recv(self.conn)

    @staticmethod
    def _result(msg, what: str):
        if msg[0] == "ok":
            return msg[1]
        assert msg[0] == "error", msg[0]
        _, kind, text, tb = msg
        tail = "\n".join(tb.strip().splitlines()[-12:])
        cls = next((c for c in PASSED if c.__name__ == kind), None)
        if cls is not None:
            raise cls(f"{text} (SGLang engine process, {what})")
        raise RuntimeError(f"{what} failed in the SGLang engine process: {kind}: {text}\n{tail}")

    def _request(self, op: str, *args):
        if self.conn is None or not self._finalizer.alive:
            raise RuntimeError("the SGLang engine process was shut down")
        with self._lock:
            send(self.conn, (op, *args))
            return self._result(self._recv(), op)

    # ---- Engine's calls ---------------------------------------------------------------------------
    def generate(self, **kw) -> list:
        return self._request("generate", kw)

    def generate_groups(self, kw: dict, starts: Sequence[int]) -> Iterator[tuple[int, list]]:
        with self._lock:
            if self.conn is None or not self._finalizer.alive:
                raise RuntimeError("the SGLang engine process was shut down")
            send(self.conn, ("groups", kw, list(starts)))
            finished = False
            try:
                while True:
                    msg = self._recv()
                    if msg[0] != "group":
                        finished = True
                        self._result(msg, "generate_groups")
                        return
                    yield msg[1], msg[2]
            finally:
                if not finished and self.proc.poll() is None:
                    send(self.conn, ("cancel",))
                    while self._recv()[0] == "group":  # answers already on their way, then the end
                        pass

    def release_memory_occupation(self, tags=None):
        return self._request("release_memory_occupation", tags)

    def resume_memory_occupation(self, tags=None):
        return self._request("resume_memory_occupation", tags)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        """One payload per TP rank, each a dump of the (name, tensor) list (SGLang's own form); the tensors
        must stay alive until this returns (the scheduler maps them)."""
        payload = tensor_ipc.dumps([(name, t.detach()) for name, t in named_tensors])
        return self._request("update_weights", [payload] * self.tp_size, load_format, flush_cache)

    def collective_rpc(self, method: str, **kwargs):
        return self._request("collective_rpc", method, kwargs)

    def call(self, op: str, **params) -> Any:
        """Control op `op` of the hook in every scheduler process (RollplexEngine.call there)."""
        return self._request("call", op, params)

    def _path(self, what: str) -> str:
        return os.path.join(self.rollplex_dir, f"{next(self._calls)}-{what}")

    def shutdown(self) -> None:
        if self.conn is not None and self._finalizer.alive and self.proc.poll() is None:
            with self._lock:
                try:
                    send(self.conn, ("shutdown",))
                    self._recv(120)
                except (OSError, EOFError, RuntimeError, TimeoutError):
                    pass
        self._finalizer()


def _stop(proc: subprocess.Popen, directory: str) -> None:
    """Let the engine process end (it does after `shutdown`), else terminate it (it shuts SGLang down on
    SIGTERM), else kill it; then remove the socket's directory."""
    for wait, act in ((10, proc.terminate), (60, proc.kill), (30, None)):
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            if act is not None:
                act()
    shutil.rmtree(directory, ignore_errors=True)
