"""Optional API-key auth: with a key set, every endpoint but `/health` needs `Authorization: Bearer <key>`.

A plain ASGI middleware (like `http_metrics`): it answers a 401 in the API's error shape before the
route, or the body, is read. The key is compared in constant time (`hmac.compare_digest`), so the
time of a refusal says nothing about how much of a guess was right. `/health` stays open for load
balancers and Serve's own probes; `/metrics` needs the key like the rest (Prometheus sends it with
`authorization: {credentials: ...}` in its scrape config).
"""

from __future__ import annotations

import hmac
import os

from starlette.types import ASGIApp, Receive, Scope, Send

from specserve.api import API_KEY_ENV
from specserve.api.errors import ApiError

OPEN_PATHS = frozenset({"/health"})


def check_api_key(key: str) -> str:
    """`key`, if it can travel in an Authorization header (printable ASCII, no spaces); else ValueError."""
    if not key or not all(33 <= ord(c) < 127 for c in key):
        raise ValueError("api_key: must be non-empty printable ASCII without spaces")
    return key


def resolve_api_key(configured: str | None) -> str | None:
    """The key the app requires: the configured one, else `$SPECSERVE_API_KEY` where the app runs (an
    ingress replica reads its own environment), else None (no auth)."""
    key = configured or os.environ.get(API_KEY_ENV) or None
    return None if key is None else check_api_key(key)


def route_path(scope: Scope) -> str:
    """The path the app routes on: under a Serve route prefix, without that prefix (`root_path`)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return (path[len(root) :] or "/") if root and path.startswith(root) else path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = check_api_key(api_key).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = ApiError(
            401,
            "a valid API key is required: send `Authorization: Bearer <key>`",
            type="authentication_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        # compare_digest runs whatever the scheme, so a wrong scheme costs the same as a wrong key.
        matches = hmac.compare_digest(token.strip(), self._key)
        return scheme.lower() == b"bearer" and matches
