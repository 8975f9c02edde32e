"""The HTTP connection layer: uvicorn's h11 protocol with a connection cap and a header timeout.

    uvicorn.Config(app, **uvicorn_options(limits, keep_alive))

uvicorn bounds the header size (`h11_max_incomplete_event_size`) and idle keep-alive connections
(`timeout_keep_alive`), but has no limit on how many connections are open nor on how long a client
may take to send a request's headers: half-open connections and byte-by-byte headers hold a
descriptor each, and once descriptors run out every accept fails (and logs). `GuardedH11` adds both:

    connections   a connection over `limits.connections()` is closed as it is accepted, before
                  anything is read or logged
    headers       a connection that has not sent complete request headers `header_timeout_s` after it
                  opened (or after keep-alive + header_timeout_s since its last answer) is closed

The body's own timeout and size limit are the ASGI middleware's (app.py), which answers 408 / 413.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import ServerLimits

MAX_HEADER_BYTES = 64 << 10  # request line + headers (h11's default is 16 KiB; a bearer token fits either)


class GuardedH11(H11Protocol):
    max_connections: int = 1024  # set by `protocol`
    header_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # nothing read, nothing logged: a flood of these must cost nothing
            return
        self._arm_header_timer(self.header_timeout_s)

    def _arm_header_timer(self, delay: float) -> None:
        self._headers_of = self.scope  # the request in progress when armed (None before the first)
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = self.loop.call_later(delay, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.scope is self._headers_of and not self.transport.is_closing():
            self.transport.close()  # no new request's headers arrived in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer(self.timeout_keep_alive + self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        super().connection_lost(exc)


def protocol(limits: ServerLimits) -> type[GuardedH11]:
    """A GuardedH11 subclass carrying these limits (uvicorn instantiates the class per connection)."""
    return type("GuardedH11", (GuardedH11,), {"max_connections": limits.connections(),
                                              "header_timeout_s": limits.header_timeout_s})


def uvicorn_options(limits: ServerLimits, keep_alive: float) -> dict:
    """Keyword arguments of uvicorn.Config for these limits."""
    return {"http": protocol(limits), "timeout_keep_alive": keep_alive,
            "h11_max_incomplete_event_size": MAX_HEADER_BYTES}
