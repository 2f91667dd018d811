"""`make_app(client)`: the FastAPI app of the OpenAI and native routes over any `EngineClient`.

Free of Ray: the Ray Serve ingress wraps this app around its own client, and tests and the
single-process server wrap it around `specserve.engine.async_engine.AsyncEngine`.
"""

from __future__ import annotations

from fastapi import FastAPI

from specserve import __version__
from specserve.api.auth import ApiKeyMiddleware
from specserve.api.body_limit import BodyLimitMiddleware
from specserve.api.client import EngineClient
from specserve.api.errors import ERROR_RESPONSES, install_error_handlers
from specserve.api.http_metrics import HttpMetricsMiddleware
from specserve.api.limits import MAX_BODY_BYTES
from specserve.api.native_routes import native_router
from specserve.api.openai_routes import openai_router
from specserve.metrics import LOCAL, HttpMetrics


def make_app(
    client: EngineClient,
    *,
    title: str = "specserve",
    replica: str = LOCAL,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    disconnects: tuple[type[BaseException], ...] = (),
) -> FastAPI:
    """`replica`: this app's label on its HTTP metrics (the ingress replica id under Ray Serve).
    `api_key`: when set, every route but /health needs it as a Bearer token. `max_body_bytes`: a
    bigger request body is a 413. `disconnects`: the host's exceptions for a client gone away."""
    app = FastAPI(title=title, version=__version__)
    app.state.engine_client = client
    app.state.http_metrics = http_metrics = HttpMetrics(client.model_name, replica)
    install_error_handlers(app, disconnects)
    # The last added runs first: count every response (401s and 413s too), then authenticate before
    # anything of the body is read, then cap the body.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(HttpMetricsMiddleware, metrics=http_metrics)
    app.include_router(openai_router(client), responses=ERROR_RESPONSES)
    app.include_router(native_router(client, http_metrics), responses=ERROR_RESPONSES)
    return app
