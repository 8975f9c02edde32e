"""FastAPI app: routes, bearer auth, request counting, and one error shape for every failure.

    GET  /health   {"status": "ok", model, mode, rollout_backend, device, global_step, weights_version,
                    retained_rollouts, engine: {waiting, running} (null with the SGLang backend), startup_s:
                    seconds per startup phase, ...}
    GET  /checksum {weights_checksum, optimizer_checksum (floats over the policy's parameters and the
                   optimizer's masters, moments and step counts), global_step, weights_version,
                   lr_schedule_step, retained_rollouts (ids)}: what a train step or a load changes; a
                   pass over every weight on the engine thread, so behind the API key like the rest
    GET  /metrics  Prometheus text (metrics.py)
    GET  /memory   bytes per region: weights, ref_weights, kv_cache, optimizer_state, grads,
                   retained_rollouts (+ torch.cuda allocator stats on GPU); `manager`: the memory manager's
                   backend, current phase, plan, region states and the per-phase ledger
    POST /generate (routes_generate.py)   POST /rollout /train_step /save /load (routes_rl.py)
    SGLang's utility endpoints (routes_sglang.py): GET /health_generate /get_model_info /model_info
    /get_server_info /server_info /v1/models, GET|POST /flush_cache

Auth: with an API key, every route except /health and /metrics needs `Authorization: Bearer KEY`
(checked before the body is read, for every method, OPTIONS included; 401 otherwise). An empty key is
refused at startup (it would switch auth off without saying so). Only POSTs to the routes that take a
body have it read (within --body-timeout-s: 408 after it; over --max-body-bytes: 413), and its JSON
shape is bounded (--max-json-containers: 413) before it is parsed, off the event loop (body.py).
Request counters have a fixed label set: route (unknown paths are "other"), method (unknown methods
are "other"), status. Errors: `{"error": {"code", "message"}, "detail"}`;
every bad request is 400, as with SGLang — malformed JSON, schema violations (wrong types, missing
or unknown fields) and values the runtime rejects alike; unknown rollouts 404; a concurrent train
step, a rollout sampled from older weights or a save onto an existing checkpoint 409; a train step that
does not fit in device memory 507, one whose loss or gradients are not finite 422 (each says what of
the step was applied: routes_rl.py); a body over --max-body-bytes 413 (before it is parsed). Nothing a
client sends reaches the engine unvalidated, and a failing request never touches retained rollouts or
in-flight work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import routes_generate, routes_rl, routes_sglang
from .limits import containers_message, count_containers, flag
from .state import ServerState

log = logging.getLogger("rollplex.server")
OPEN_ROUTES = ("/health", "/metrics")
BODY_ROUTES = ("/generate", "/rollout", "/train_step", "/save", "/load")  # POST, JSON body
SGLANG_ROUTES = ("/health_generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info",
                 "/flush_cache", "/v1/models")  # routes_sglang.py
ROUTES = ("/health", "/checksum", "/metrics", "/memory", *SGLANG_ROUTES, *BODY_ROUTES)
METHODS = ("GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH")  # metric labels; others are "other"


def check_api_key(key: str | None) -> str | None:
    """The API key, or ValueError for an empty one (it would switch auth off without a word)."""
    if key is not None and not key.strip():
        raise ValueError("the API key is empty: pass a non-empty --api-key (or $ROLLPLEX_API_KEY), or none to "
                         "serve without auth")
    return key


def error(code: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}, "detail": message}, code, headers=headers)


class AuthAndCount:
    """Pure ASGI middleware (streaming- and disconnect-safe): bearer auth, the body's limits, and per-route
    request counters. The body is read here, after auth and before anything parses it, and only for a POST
    to a route that takes one (no other route reads a body: uvicorn drops it with the connection): a
    Content-Length over the limit is answered 413 at once, a streamed (chunked) body as soon as it passes
    the limit, one that does not arrive within body_timeout_s 408, one with too many JSON containers 413;
    the app then receives the whole body as one message (its later receives, for disconnects, pass through)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        key = check_api_key(state.cfg.api_key)
        self.key = key.encode() if key is not None else None
        self.limits = state.cfg.limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        route = path if path in ROUTES else "other"
        status = [500]

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.key is not None and path not in OPEN_ROUTES:
                auth = dict(scope["headers"]).get(b"authorization", b"")
                scheme, _, token = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                    resp = error(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                 {"WWW-Authenticate": "Bearer", "Connection": "close"})
                    return await resp(scope, receive, send_counted)
            if method == "POST" and path in BODY_ROUTES:
                replay, refusal = await self._read_body(scope, receive)
                if refusal is not None:
                    return await refusal(scope, receive, send_counted)
                receive = replay
            await self.app(scope, receive, send_counted)
        finally:
            self.state.metrics.inc("rollplex_http_requests_total", route=route,
                                   method=method if method in METHODS else "other", status=status[0])

    async def _read_body(self, scope, receive):
        """(a receive channel that first gives the whole body, None) or (None, the error response)."""
        limit = self.limits.max_body_bytes
        too_big = error(413, f"request body is over the server's limit of {limit} bytes ({flag('max_body_bytes')})",
                        {"Connection": "close"})
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None, too_big
        chunks, size, first = [], 0, None
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client left: the app sees that
                        first = message
                        break
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > limit:
                        return None, too_big
                    if not message.get("more_body", False):
                        first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                        break
        except TimeoutError:
            return None, error(408, f"request body not received within {self.limits.body_timeout_s:g} s "
                                    f"({flag('body_timeout_s')})", {"Connection": "close"})
        if first["type"] == "http.request":
            count = count_containers(first["body"])
            if count > self.limits.max_json_containers:
                return None, error(413, containers_message(self.limits, count), {"Connection": "close"})
        pending = [first]

        async def replay():
            return pending.pop() if pending else await receive()

        return replay, None


def _validation_message(exc: RequestValidationError) -> str:
    errs = exc.errors()
    for e in errs:
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
    parts = []
    for e in errs:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "invalid request: " + "; ".join(dict.fromkeys(parts))


def create_app(state: ServerState) -> FastAPI:
    check_api_key(state.cfg.api_key)  # here too: the middleware stack is only built on the first request
    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def purge():
            while True:
                await asyncio.sleep(5.0)
                state.store.purge()

        task = asyncio.create_task(purge())
        state.mark_ready()
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="Rollplex", version="0.1.0", lifespan=lifespan)
    app.state.rollplex = state

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return error(400, _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.get("/health")
    async def health():
        return {"status": "ok", **state.describe(), "engine": state.engine_counts()}

    @app.get("/checksum")
    async def checksum():
        return await state.worker.run(state.fingerprint)

    @app.get("/metrics")
    async def metrics():
        counts = state.engine_counts()
        gauges = {"rollplex_retained_rollouts": len(state.store), "rollplex_global_step": state.rl.step_idx,
                  "rollplex_weights_version": state.weights_version,
                  **({"rollplex_engine_waiting": counts["waiting"], "rollplex_engine_running": counts["running"]}
                     if counts is not None else {}),
                  **state.last_train}
        text = state.metrics.render(gauges, {"rollplex_requests_aborted_total": state.worker.num_aborted})
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/memory")
    async def memory():
        return await state.worker.run(state.ledger)

    app.include_router(routes_generate.router(state))
    app.include_router(routes_rl.router(state))
    app.include_router(routes_sglang.router(state))
    app.add_middleware(AuthAndCount, state=state)
    return app

