"""Helpers for the tests through Ray Serve (a helper module, not a test file): deploy an app of
specserve on the shared local Ray instance (`ray_serve_url` in conftest), reach its engine replicas."""

from __future__ import annotations

import time
from typing import Any

from ray import serve

ENGINE = "SpecServeEngine"
INGRESS = "SpecServeIngress"


def deploy(name: str, route: str, **args: Any) -> None:
    """Run `build_app(args)` as app `name` on `route` (CPU, fp32, small KV) and wait until it runs."""
    from specserve.serve.app import build_app

    # Replicas push metrics to the app's hub every half second: /metrics catches up quickly.
    base = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192, "metrics_push_interval_s": 0.5}
    serve.run(build_app({**base, **args}), name=name, route_prefix=route, blocking=False)
    deadline = time.monotonic() + 300
    while (status := serve.status().applications[name].status) != "RUNNING":
        assert status != "DEPLOY_FAILED", serve.status().applications[name]
        assert time.monotonic() < deadline, "app did not start"
        time.sleep(0.5)


def engine(app: str):
    """A handle to `app`'s engine deployment (Serve picks the replica of each call)."""
    return serve.get_deployment_handle(ENGINE, app_name=app)


def kv_clean(app: str) -> None:
    """Invariant 4 on an engine replica of `app`, once idle: no leaked KV page."""
    report = engine(app).check_kv_accounting.remote().result(timeout_s=60)
    assert report["ok"], report


def running_replicas(app: str, deployment: str = ENGINE) -> int:
    states = serve.status().applications[app].deployments[deployment].replica_states
    return sum(n for state, n in states.items() if state == "RUNNING")
