"""A cap on the request body: a bigger one is a 413 before the app reads it (a plain ASGI middleware).

With a `Content-Length` the check needs no byte of the body. Without one (chunked upload) the body is
read here up to the cap, then replayed to the app, which would have read all of it anyway (every
route parses a whole JSON body): so a client can make a replica hold at most the cap per request.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.api.errors import ApiError


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_body_bytes: must be >= 1")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left: let the app see it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        pending = iter(messages)

        async def replay() -> Message:
            return next(pending, None) or await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = ApiError(413, f"body: the request body exceeds the limit of {self.max_bytes} bytes", "body")
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before the app sees it
    return None
