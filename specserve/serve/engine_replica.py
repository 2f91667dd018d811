"""The engine deployment: each replica is one tensor-parallel group serving one model.

The replica actor is rank 0: it runs the whole engine (scheduler, KV manager, drafter, sampling) in an
`AsyncEngine` thread and broadcasts each step's inputs to ranks 1..N-1 (`TPFollower` actors in the
replica's placement group). The ingress reaches it through a deployment handle: `generate` streams
`RequestOutput`s; when the caller cancels the call (client disconnect) the request is aborted.

A replica that can no longer serve fails fast and is replaced: when an engine step raises, or a TP
follower dies (watched from the event loop, so this works even while the engine thread is blocked in
a collective with the dead rank), every open request ends with a 503, new ones are refused with a
503, and `check_health` raises until Serve replaces the replica (which starts new followers; the old
ones die with the replica actor that owns them).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

from ray import serve

from specserve.api.client import EngineOverloaded, ModelInfo, Prompt, Refusal
from specserve.serve.autoscaling import LoadReport
from specserve.serve.config import ServeConfig
from specserve.serve.metrics_hub import MetricsPusher, current_replica
from specserve.serve.placement import FollowerGroup, start_followers
from specserve.types import RequestOutput, SamplingParams

logger = logging.getLogger("specserve.serve")


@serve.deployment(name="SpecServeEngine")
class EngineReplica:
    def __init__(self, config: dict[str, Any], gpu: bool) -> None:
        from specserve.engine.async_engine import AsyncEngine
        from specserve.engine.engine import Engine
        from specserve.executor.tp_group import init_tp_group, pick_rendezvous_address, tp_backend

        self.config = ServeConfig.model_validate(config)
        # Ray decided the accelerator when it placed the replica (`placement.uses_gpu`).
        device = "cuda" if gpu else "cpu"
        engine_config = replace(self.config.engine_config(), device=device)
        self.followers: FollowerGroup | None = None
        _, self.replica_id = current_replica()
        tp = None
        if self.config.tp_size > 1:
            address = pick_rendezvous_address()
            self.followers = start_followers(
                self.config, asdict(engine_config), address, gpu, self.replica_id
            )
            torch_device = engine_config.torch_device()
            tp = init_tp_group(
                0,
                self.config.tp_size,
                address,
                tp_backend(torch_device),
                torch_device,
                self.config.tp_timeout_s,
            )
        engine = Engine(engine_config, tp=tp)
        self.engine = AsyncEngine(
            engine,
            max_queued_requests=self.config.max_queued_requests,
            model_name=self.config.model_name,
            replica=self.replica_id,
            fail_on_step_error=True,  # its state may be broken (a dead rank, a device error): replace it
            keepalive_s=self.config.tp_timeout_s / 4 if tp is not None else None,
            stream_messages_per_s=self.config.stream_messages_per_s,
        )
        self._stopping = False
        self._watcher = None
        if self.followers is not None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_followers(self.followers))
        self.pusher = MetricsPusher(
            self.config.model_name, self.engine.metrics.exposition, self.config.metrics_push_interval_s
        )
        # The model, Ray and transformers leave a large heap of long-lived objects; frozen, the cyclic
        # collector stops walking them between decode steps (a full pass costs tens of milliseconds).
        gc.collect()
        gc.freeze()
        logger.info("engine replica up: %s, tp=%d on %s", self.config.model_name, self.config.tp_size, device)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput | Refusal]:
        try:
            async for out in self.engine.generate(prompt, params, request_id):
                yield out
        except (ValueError, EngineOverloaded) as err:  # the client's input, or load: no failure here
            yield Refusal(err)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def flush_cache(self) -> bool:
        return await self.engine.flush_cache()

    async def health(self) -> dict[str, Any]:
        return {**await self.engine.health(), "replica": self.replica_id}

    async def model_info(self) -> ModelInfo:
        return await self.engine.model_info()

    async def metrics_text(self) -> str:
        return await self.engine.metrics_text()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's hook: this replica's load, for `specserve.serve.autoscaling.EngineLoadPolicy`."""
        load = await self.engine.health()
        report = LoadReport(
            running=int(load["num_running"]),
            waiting=int(load["num_waiting"]),
            kv_usage=float(load["kv_cache_usage"]),
            ttft_s=float(load["ttft_recent_s"] or 0.0),
        )
        return report.as_metrics()

    async def check_health(self) -> None:
        """Ray Serve's health probe: a failed engine (a step raised, a TP follower died) or a dead
        engine thread marks the replica unhealthy, and Serve replaces it."""
        await self.engine.health()  # raises EngineUnavailable after `fail`, or when the thread died
        if self.followers is not None and (why := self.followers.failed()):
            raise RuntimeError(why)

    async def _watch_followers(self, followers: FollowerGroup) -> None:
        reason = await followers.first_failure()
        if not self._stopping:  # at shutdown the followers leave on purpose
            self.engine.fail(f"{reason}; this replica will be replaced")

    async def check_kv_accounting(self) -> dict[str, Any]:
        """Invariant 4 on this replica once it is idle (tests and operators: no leaked KV page)."""
        return await self.engine.check_kv_accounting()

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: abort what runs, release the followers.
        self._stopping = True
        if getattr(self, "pusher", None) is not None:
            self.pusher.stop()
        engine, followers = getattr(self, "engine", None), getattr(self, "followers", None)
        broken = engine is not None and engine.failure is not None
        if broken and followers is not None:
            followers.kill()  # first: the engine thread may be blocked in a collective with them
        if engine is not None:
            engine.shutdown(timeout=5.0 if broken else 60.0)
        if followers is not None:
            followers.kill()
