"""What the HTTP layer needs of an engine, wherever the engine runs.

`EngineClient` is the seam between `specserve.api` (schemas, routes, SSE) and the engines behind
it: `specserve.engine.async_engine.AsyncEngine` runs one engine in this process, and the Ray Serve
ingress (`specserve.serve`) forwards to engine replicas through deployment handles. The routes are
written once against this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specserve.types import RequestOutput, SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    """Messages the engine renders with the model's chat template (assistant turn opened)."""

    messages: tuple[dict[str, Any], ...]


Prompt = str | Sequence[int] | ChatPrompt


@dataclass(frozen=True)
class Refusal:
    """A request an engine replica refused (bad input: a ValueError naming the field; or overload),
    sent back as a value rather than raised: Ray Serve logs every exception a replica raises as a
    failed request with its traceback, ~34 lines for each 400. `HandleClient` raises `error`."""

    error: Exception


@dataclass(frozen=True)
class ModelInfo:
    """What `/v1/models` and request validation need to know of the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    created: int  # unix time the engine started


class EngineOverloaded(Exception):
    """The engine's bounded queue is full: the client should retry after `retry_after` seconds (429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailable(Exception):
    """No engine can take the request now (starting, shutting down, a replica died): 503."""

    def __init__(self, message: str, retry_after: float = 5.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStepError(EngineUnavailable):
    """The engine step computing this request raised, and the request was aborted: a 503 like any
    failed engine (under Ray Serve that replica reports unhealthy and is replaced; a retry reaches a
    healthy one). An `EngineUnavailable` so every layer that maps those maps this too."""


class EngineClient(Protocol):
    model_name: str  # the served model's name (the `model` label of the app's metrics)

    async def model_info(self) -> ModelInfo: ...

    def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas in `delta_text` / `delta_token_ids`, the last one
        `finished`). Raises ValueError naming the field for bad input (before any output),
        EngineOverloaded / EngineUnavailable. Closing or cancelling the iterator aborts the request
        and frees its KV pages."""
        ...

    async def abort(self, request_id: str) -> bool: ...

    async def flush_cache(self) -> bool: ...

    async def health(self) -> dict[str, Any]:
        """Load figures when healthy; raises EngineUnavailable when not."""
        ...

    async def metrics_text(self) -> str:
        """The Prometheus exposition text of every engine behind this client."""
        ...
