"""The SGLang engine process: `python -m engine_patches.sglang.engine_process SOCKET` (started by remote.py).

It runs with SGLang's own PYTHONPATH, listens on the unix socket SOCKET for one connection (authenticated by
the key in $ROLLPLEX_ENGINE_AUTHKEY), builds engine.RollplexEngine from the first message
`("start", hook_spec, server_args)` and answers `("ok", {"version", "tp_size"})`. Then each request
`(op, *args)` gets `("ok", result)` or `("error", type name, message, traceback)`:

    generate(kw)                                  Engine.generate(**kw)
    groups(kw, starts)                            ("group", i, answers) per prompt as it finishes
                                                  (groups.iter_groups), then ("ok", None); a ("cancel",)
                                                  between two groups cancels the rest
    release_memory_occupation(tags) / resume_memory_occupation(tags)
    update_weights(payloads, load_format, flush_cache)
                                                  what Engine.update_weights_from_tensor sends, with the
                                                  trainer's payloads (already serialized, one per TP rank)
    call(op, params), collective_rpc(method, kwargs)
    shutdown()                                    Engine.shutdown, answer, exit

SIGTERM shuts SGLang down too. A "cancel" that arrives after its stream ended is ignored.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Listener

from .groups import iter_groups
from .remote import AUTHKEY_ENV, recv, send


def update_weights(engine, payloads: list, load_format, flush_cache: bool):
    """Engine.update_weights_from_tensor's request, with the payloads serialized by the trainer's process."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

    obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=list(payloads), load_format=load_format,
                                          flush_cache=flush_cache)
    return engine.loop.run_until_complete(engine.tokenizer_manager.update_weights_from_tensor(obj, None))


OPS = {
    "generate": lambda e, kw: e.generate(**kw),
    "release_memory_occupation": lambda e, tags: e.release_memory_occupation(tags=tags),
    "resume_memory_occupation": lambda e, tags: e.resume_memory_occupation(tags=tags),
    "update_weights": update_weights,
    "call": lambda e, op, params: e.call(op, **params),
    "collective_rpc": lambda e, method, kwargs: e.collective_rpc(method, **kwargs),
}


def _error(e: BaseException) -> tuple:
    return ("error", type(e).__name__, str(e), traceback.format_exc())


def _stream(conn, engine, kw: dict, starts: list) -> None:
    answers = iter_groups(engine, kw, starts)
    try:
        for i, raw in answers:
            send(conn, ("group", i, raw))
            if conn.poll(0):
                msg = recv(conn)
                assert msg[0] == "cancel", f"{msg[0]!r} while a rollout streams"
                break
    finally:
        answers.close()


def serve(conn) -> None:
    msg = recv(conn)
    assert msg[0] == "start", msg[0]
    _, spec, server_args = msg
    try:
        from importlib import metadata

        from .engine import load_engine_class

        engine = load_engine_class()(hook_spec=spec, **server_args)
        version = metadata.version("sglang")
    except Exception as e:  # noqa: BLE001 - every start failure goes back to the trainer
        send(conn, _error(e))
        return
    args = getattr(engine, "server_args", None)
    tp = getattr(args, "tp_size", None) if not isinstance(args, dict) else args.get("tp_size")
    send(conn, ("ok", {"version": version, "tp_size": tp or 1}))
    try:
        while True:
            try:
                msg = recv(conn)
            except EOFError:
                return
            op, args = msg[0], msg[1:]
            if op == "cancel":
                continue
            if op == "shutdown":
                break
            try:
                if op == "groups":
                    _stream(conn, engine, *args)
                    send(conn, ("ok", None))
                else:
                    send(conn, ("ok", OPS[op](engine, *args)))
            except Exception as e:  # noqa: BLE001 - reported to the trainer, the engine keeps serving
                send(conn, _error(e))
    finally:
        engine.shutdown()
    send(conn, ("ok", None))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or AUTHKEY_ENV not in os.environ:
        print("usage: python -m engine_patches.sglang.engine_process SOCKET (started by remote.RemoteEngine)",
              file=sys.stderr)
        return 2
    key = bytes.fromhex(os.environ.pop(AUTHKEY_ENV))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through serve(): SGLang shuts down
    with Listener(argv[0], family="AF_UNIX", authkey=key) as listener:
        conn = listener.accept()
    serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
