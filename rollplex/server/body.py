"""Request bodies parsed off the event loop: a route class whose requests decode their JSON on a thread.

    APIRouter(route_class=JSONOffLoop)

FastAPI decodes a JSON body with `await request.json()`, on the event loop: a large body (millions of
token ids) would hold up every other connection, `/health` included, while it is decoded. Here the
decode runs on a thread (asyncio.to_thread). The C decoder holds the GIL while it runs, so the numbers
go through Python-level hooks: the interpreter can hand the GIL to the event loop between two of them,
and the arrays and objects, which need no hook, are bounded before any of this by
`--max-json-containers` (app.py counts them in the raw bytes). Validation (pydantic) then runs on the
loop over the decoded body; the schemas keep it linear (schemas.py).

Malformed JSON raises json.JSONDecodeError from `request.json()`, which FastAPI answers as before (400).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute


def _int(s: str) -> int:  # a Python frame per number: a point where the GIL can change hands
    return int(s)


def _float(s: str) -> float:
    return float(s)


def loads(body: bytes) -> Any:
    """json.loads, with the numbers decoded by Python hooks (same values as the defaults)."""
    return json.loads(body, parse_int=_int, parse_float=_float)


class OffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await asyncio.to_thread(loads, await self.body())
        return self._json


class JSONOffLoop(APIRoute):
    """An APIRoute whose handler sees an `OffLoopRequest` (FastAPI's documented custom-request pattern)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request):
            return await handler(OffLoopRequest(request.scope, request.receive))

        return handle
