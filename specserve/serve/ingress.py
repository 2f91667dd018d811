"""The HTTP ingress deployment: specserve's FastAPI app (OpenAI + native routes) under Ray Serve.

The app is built on each ingress replica at start (`__serve_build_asgi_app__`) over a `HandleClient`
to the engine deployment, so the routes are exactly those the in-process server runs. Ingress
replicas hold no model: they parse, validate, stream and translate errors.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from specserve.api.auth import resolve_api_key
from specserve.serve.handle_client import HandleClient
from specserve.serve.metrics_hub import HubReader, MetricsPusher, current_replica


@serve.deployment(name="SpecServeIngress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    def __init__(
        self,
        engine: DeploymentHandle,
        model_name: str,
        metrics_push_interval_s: float = 2.0,
        api_options: dict[str, Any] | None = None,
    ) -> None:
        app_name, self.replica_id = current_replica()
        self.client = HandleClient(engine, model_name, metrics=HubReader(app_name))
        self.metrics_push_interval_s = metrics_push_interval_s
        # The key given in the config, else this replica's own SPECSERVE_API_KEY (a secret set in the
        # cluster's environment need not appear in any config file).
        self.api_options = dict(api_options or {})
        self.api_options["api_key"] = resolve_api_key(self.api_options.get("api_key"))
        self.pusher: MetricsPusher | None = None

    def __serve_build_asgi_app__(self):
        from ray.exceptions import TaskCancelledError

        from specserve.api.app import make_app

        # The proxy cancels this task when the client disconnects: a 499, not a failed request.
        app = make_app(
            self.client, replica=self.replica_id, disconnects=(TaskCancelledError,), **self.api_options
        )
        # Its HTTP counts go to the hub too, so a scrape of any one ingress replica has every one's.
        self.pusher = MetricsPusher(
            self.client.model_name,
            app.state.http_metrics.exposition,
            self.metrics_push_interval_s,
            engine=False,
        )
        return app

    def __del__(self) -> None:
        if getattr(self, "pusher", None) is not None:
            self.pusher.stop()
