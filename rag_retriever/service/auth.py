"""API keys of the HTTP service: is this request carrying that key?

Example:
    >>> authorised({"headers": [(b"x-api-key", b"s3cret")]}, b"s3cret")
    True

A key is sent as `Authorization: Bearer <key>` or `X-API-Key: <key>` and compared in constant
time. This module does not know which paths need which key (server.py and writes.py do).
"""

from __future__ import annotations

import hmac
from typing import Any


def authorised(scope: Any, key: bytes) -> bool:
    # Constant-time comparison: the time taken says nothing about how much of the key matched.
    return any(hmac.compare_digest(o.encode("utf-8", "replace"), key) for o in offered_keys(scope))


def offered_keys(scope: Any) -> list[str]:
    """The keys a request carries (`Authorization: Bearer` and `X-API-Key`)."""
    offered: list[str] = []
    authorization = header(scope, b"authorization")
    if authorization is not None:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            offered.append(token.strip())
    api_key = header(scope, b"x-api-key")
    if api_key is not None:
        offered.append(api_key.strip())
    return offered


def header(scope: Any, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
