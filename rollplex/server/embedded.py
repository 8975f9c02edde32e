"""A real uvicorn server in a background thread, on a socket bound before it starts (port 0 = free).

    srv = serve_in_thread(ServerConfig(model=..., device="cpu"))   # or an existing ServerState
    httpx.get(srv.url + "/health"); ...; srv.stop()

Used by the in-process mode of examples/train_grpo.py and by the tests: the HTTP path is the same as
with `python -m rollplex.server`, only the process is shared.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn

from .app import check_api_key, create_app
from .http import uvicorn_options
from .state import KEEP_ALIVE_S, ServerConfig, ServerState


@dataclass
class EmbeddedServer:
    url: str
    state: ServerState
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.state.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def serve_in_thread(cfg: ServerConfig | ServerState, host: str = "127.0.0.1", port: int = 0,
                    log_level: str = "warning", timeout: float = 60.0) -> EmbeddedServer:
    check_api_key((cfg.cfg if isinstance(cfg, ServerState) else cfg).api_key)  # before the model loads
    state = cfg if isinstance(cfg, ServerState) else ServerState(cfg)
    app = create_app(state)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2,
                                           **uvicorn_options(state.cfg.limits, KEEP_ALIVE_S)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rollplex-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            state.close()
            raise RuntimeError("the embedded server did not start")
        time.sleep(0.02)
    return EmbeddedServer(f"http://{host}:{port}", state, server, thread)
