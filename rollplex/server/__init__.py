"""The hybrid server: policy, rollout engine, reference model and trainer in one process per GPU.

    python -m rollplex.server [--model DIR_OR_PRESET] [--port 30000] ...

Modules, one job each:

    schemas.py   pydantic request models (SGLang's /generate, /rollout, /train_step, /save, /load)
    errors.py    the 400 the routes raise for values the runtime rejects
    sglang.py    SGLang request <-> rollplex SamplingParams / response dicts
    worker.py    the engine thread: continuous batching over all HTTP requests + exclusive jobs
    store.py     retained rollouts (TTL, per-client count and bytes, bytes over all) waiting for /train_step
    state.py     ServerConfig (a rollplex.system.SystemConfig + the server's settings and ServerLimits) and
                 the hosted runtime (rollplex.system.build's model, processor, engine or SGLang, RLStep;
                 store, worker) + /memory ledger
    limits.py    ServerLimits: request body, prompt count and length, image and video sizes, pixels per
                 request, retained bytes
    media.py     images and frames a request names -> decoded images (no local files without --media-root)
    rewards.py   the rewards a request may name: those registered at startup
    metrics.py   Prometheus counters and gauges for /metrics
    inflight.py  the async side of engine requests: submit, collect, abort on disconnect
    routes_generate.py   POST /generate (SGLang)
    routes_rl.py         POST /rollout, /train_step, /save, /load
    app.py       the FastAPI app: info routes, auth, the body limit, request counters, error mapping
    embedded.py  run a real uvicorn server in a background thread (driver, tests)
    group.py     under torchrun: rank 0's commands to the other ranks (the data-parallel train step)
    __main__.py  the CLI: flags generated from ServerConfig and its nested configs (rollplex/cli.py)
"""

from importlib import import_module

_EXPORTS = {"ServerConfig": "state", "ServerState": "state", "ServerLimits": "limits", "create_app": "app",
            "serve_in_thread": "embedded"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):  # lazy: importing the package loads a submodule only when one of its names is used
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(name)
