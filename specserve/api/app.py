"""`make_app(client)`: the FastAPI app of the OpenAI and native routes over any `EngineClient`.

Free of Ray: the Ray Serve ingress wraps this app around its own client, and tests and the
single-process server wrap it around `specserve.engine.async_engine.AsyncEngine`.
"""

from __future__ import annotations

from fastapi import FastAPI

from specserve import __version__
from specserve.api.client import EngineClient
from specserve.api.errors import install_error_handlers
from specserve.api.http_metrics import HttpMetricsMiddleware
from specserve.api.native_routes import native_router
from specserve.api.openai_routes import openai_router
from specserve.metrics import LOCAL, HttpMetrics


def make_app(client: EngineClient, *, title: str = "specserve", replica: str = LOCAL) -> FastAPI:
    """`replica`: this app's label on its HTTP metrics (the ingress replica id under Ray Serve)."""
    app = FastAPI(title=title, version=__version__)
    app.state.engine_client = client
    app.state.http_metrics = http_metrics = HttpMetrics(client.model_name, replica)
    install_error_handlers(app)
    app.add_middleware(HttpMetricsMiddleware, metrics=http_metrics)
    app.include_router(openai_router(client))
    app.include_router(native_router(client, http_metrics))
    return app
