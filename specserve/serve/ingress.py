"""The HTTP ingress deployment: specserve's FastAPI app (OpenAI + native routes) under Ray Serve.

The app is built on each ingress replica at start (`__serve_build_asgi_app__`) over a `HandleClient`
to the engine deployment, so the routes are exactly those the in-process server runs. Ingress
replicas hold no model: they parse, validate, stream and translate errors.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.serve.handle_client import HandleClient


@serve.deployment(name="SpecServeIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(self, engine: DeploymentHandle, api_options: dict[str, Any] | None = None) -> None:
        self.client = HandleClient(engine)
        self.api_options = api_options or {}

    def __serve_build_asgi_app__(self):
        from specserve.api.app import make_app

        return make_app(self.client, **self.api_options)
