"""Helpers for the HTTP API tests (a helper module, not a test file): a real engine behind the app."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from specserve import LLM
from specserve.api.app import make_app
from specserve.engine.async_engine import AsyncEngine

MODEL_NAME = "tiny"
SMALL_CONTEXT = 64  # max_model_len of `small_served`: requests at the limits, and fuzzing, stay cheap


@dataclass
class Served:
    client: AsyncEngine
    http: TestClient

    @property
    def app(self):
        return self.http.app

    def finished(self, reason: str) -> float:
        """How many requests finished with `reason` so far (from the engine's metrics)."""
        return self.client.metrics.sample("specserve_request_finished_total", finish_reason=reason)


@contextlib.contextmanager
def async_engine(
    loaded, *, max_queued_requests: int = 256, client_options: dict | None = None, **llm_kwargs
) -> Iterator[AsyncEngine]:
    """An AsyncEngine (model name `MODEL_NAME`) over a fresh engine on `loaded` (CPU, fp32);
    `client_options`: more AsyncEngine arguments (fail_on_step_error, keepalive_s)."""
    llm_kwargs.setdefault("max_total_tokens", 4096)
    engine = LLM(loaded, device="cpu", dtype="float32", **llm_kwargs).engine
    client = AsyncEngine(
        engine, model_name=MODEL_NAME, max_queued_requests=max_queued_requests, **(client_options or {})
    )
    try:
        yield client
    finally:
        client.shutdown()


@contextlib.contextmanager
def serve(loaded, **kwargs) -> Iterator[Served]:
    """`async_engine(loaded, **kwargs)` and a TestClient of its app."""
    with async_engine(loaded, **kwargs) as client, TestClient(make_app(client)) as http:
        yield Served(client, http)


def reference_llm(loaded, **llm_kwargs) -> LLM:
    llm_kwargs.setdefault("max_total_tokens", 4096)
    return LLM(loaded, device="cpu", dtype="float32", **llm_kwargs)


def exposed_families(text: str) -> dict[str, list]:
    """A scrape's families by exposed name (counters with `_total`) -> samples; fails on a family
    that appears twice (a merged exposition must name each once)."""
    families: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name not in families, f"{name} appears twice"
        families[name] = family.samples
    return families
