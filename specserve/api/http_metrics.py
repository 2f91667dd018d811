"""`specserve_http_requests_total{route,status}`: a plain ASGI middleware around the app.

Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which buffers through an extra task and
gets in the way of streamed (SSE) responses: this one only watches the status go by. The route is
the matched route's path template (bounded label values, unlike raw paths); the router writes the
route into the request's scope, which this middleware shares.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve.metrics import HttpMetrics

UNMATCHED = "unmatched"  # the route label of a path no route matched (a 404)


class HttpMetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers when the app raises before starting a response

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:  # a stream the client left still counts, with the status it started with
            route = scope.get("route")
            self.metrics.count(getattr(route, "path", None) or UNMATCHED, status)
