"""The HTTP error the routes raise for a request the runtime rejects (app.py renders every error)."""

from __future__ import annotations

from fastapi import HTTPException


def bad_request(message: str) -> HTTPException:
    """400: the request is well-formed but its values cannot be served (the message says why)."""
    return HTTPException(status_code=400, detail=message)
