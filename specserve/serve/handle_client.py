"""`EngineClient` over a Ray Serve deployment handle: how the ingress reaches engine replicas.

Serve routes each call to a replica (power of two choices on queue length). A streamed `generate` is
one handle call; closing it (the HTTP client went away) cancels the call, which cancels the replica's
generator, which aborts the request and frees its KV pages. Ray's wrappers around errors are taken
off here, so the routes see the same exceptions as with an in-process engine (a failed engine step,
`EngineStepError`, is an `EngineUnavailable`: a 503).

Ray moves our own objects between the ingress and the engine replicas (prompts, `SamplingParams`,
`RequestOutput`s) by pickling them: the ingress builds them from validated JSON, so no byte a client
sends is ever unpickled.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ray import exceptions as ray_exceptions
from ray.serve import exceptions as serve_exceptions
from ray.serve.handle import DeploymentHandle

from specserve.api.client import EngineOverloaded, EngineUnavailable, ModelInfo, Prompt, Refusal
from specserve.serve.metrics_hub import HubReader
from specserve.types import RequestOutput, SamplingParams

_PASS_THROUGH = (ValueError, EngineOverloaded, EngineUnavailable)
_REPLICA_GONE = (
    ray_exceptions.RayActorError,
    ray_exceptions.ActorUnavailableError,
    serve_exceptions.DeploymentUnavailableError,
    serve_exceptions.ReplicaUnavailableError,
)


class HandleClient:
    """`metrics`: where `/metrics` gets every engine replica's figures (the app's metrics hub); without
    it, from the one replica Serve routes the call to."""

    def __init__(self, handle: DeploymentHandle, model_name: str, metrics: HubReader | None = None) -> None:
        self.model_name = model_name
        self._metrics = metrics
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._inflight: dict[str, Any] = {}
        self._info: ModelInfo | None = None

    async def model_info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self._call("model_info")
        return self._info

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        request_id = request_id or uuid.uuid4().hex
        call, finished = None, False
        try:
            # `.remote()` itself may refuse (the deployment's queue is full): translate that too.
            call = self._inflight[request_id] = self._stream.generate.remote(prompt, params, request_id)
            async for out in call:
                if isinstance(out, Refusal):
                    raise out.error
                finished = out.finished
                yield out
        except Exception as err:
            finished = True  # the call failed: nothing is left to cancel
            raise translate(err) from err
        finally:
            if call is not None and self._inflight.get(request_id) is call:  # a reused id is not ours
                del self._inflight[request_id]
            if call is not None and not finished:
                _cancel(call)  # reaches the replica's generator: the engine aborts the request

    async def abort(self, request_id: str) -> bool:
        call = self._inflight.pop(request_id, None)
        if call is None:
            return False
        _cancel(call)
        return True

    async def flush_cache(self) -> bool:
        return await self._call("flush_cache")

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def metrics_text(self) -> str:
        if self._metrics is not None:
            return await self._metrics.text()
        return await self._call("metrics_text")

    async def _call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self._handle, method).remote(*args)
        except Exception as err:
            raise translate(err) from err


def _cancel(call: Any) -> None:
    # A call that failed while being routed re-raises its error from cancel(): it is over anyway.
    with contextlib.suppress(Exception):
        call.cancel()


def translate(err: BaseException) -> BaseException:
    """The engine-side exception behind a Ray error, or EngineOverloaded / EngineUnavailable."""
    if isinstance(err, serve_exceptions.BackPressureError):
        return EngineOverloaded("the engine deployment's queue is full", retry_after=1.0)
    if isinstance(err, _REPLICA_GONE):
        return EngineUnavailable(f"no engine replica could take the request: {type(err).__name__}")
    cause = getattr(err, "cause", None)
    if isinstance(err, ray_exceptions.RayTaskError) and isinstance(cause, _PASS_THROUGH):
        return cause
    if isinstance(err, _PASS_THROUGH):
        return err
    if isinstance(err, ray_exceptions.RayError | serve_exceptions.RayServeException):
        return EngineUnavailable(f"the engine replica failed: {type(err).__name__}")
    return err
