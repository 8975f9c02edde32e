"""The server under benchmark as a subprocess: its command line, start, readiness and stop.

`python -m rollplex.server` started the way a user starts it (serve.py's rounds and serve_load.py's
load mode both use these), so what is timed includes the process's own start.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time


def server_command(model: str | None, port: int, server_args: str) -> list[str]:
    return [sys.executable, "-m", "rollplex.server", *(["--model", model] if model else []), "--port", str(port),
            *shlex.split(server_args)]


def start_server(cmd: list[str], log: str | None = None, env: dict | None = None,
                 append: bool = False) -> subprocess.Popen:
    """The server as a subprocess; its output goes to `log` (appended to with `append`), else to ours."""
    out = open(log, "a" if append else "w") if log else None  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                            env=dict(os.environ) if env is None else env)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, since: float, poll: float = 0.1) -> float:
    """Seconds until /health answers 200, counted from `since`: a `time.perf_counter()` taken before the
    server was started (the process may run a while before Popen returns to us)."""
    import httpx

    while time.perf_counter() - since < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.perf_counter() - since
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise SystemExit(f"the server was not ready after {timeout:.0f} s")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
