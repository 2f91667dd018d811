"""The engine deployment: each replica is one tensor-parallel group serving one model.

The replica actor is rank 0: it runs the whole engine (scheduler, KV manager, drafter, sampling) in an
`AsyncEngine` thread and broadcasts each step's inputs to ranks 1..N-1 (`TPFollower` actors in the
replica's placement group). The ingress reaches it through a deployment handle: `generate` streams
`RequestOutput`s; when the caller cancels the call (client disconnect) the request is aborted.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

from ray import serve

from specserve.api.client import ModelInfo, Prompt
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
        tp = None
        if self.config.tp_size > 1:
            address = pick_rendezvous_address()
            self.followers = start_followers(self.config, asdict(engine_config), address, gpu)
            torch_device = engine_config.torch_device()
            tp = init_tp_group(0, self.config.tp_size, address, tp_backend(torch_device), torch_device)
        engine = Engine(engine_config, tp=tp)
        _, self.replica_id = current_replica()
        self.engine = AsyncEngine(
            engine,
            max_queued_requests=self.config.max_queued_requests,
            model_name=self.config.model_name,
            replica=self.replica_id,
        )
        self.pusher = MetricsPusher(
            self.config.model_name, self.engine.metrics.exposition, self.config.metrics_push_interval_s
        )
        logger.info("engine replica up: %s, tp=%d on %s", self.config.model_name, self.config.tp_size, device)

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt, params, request_id):
            yield out

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
        """Ray Serve's health probe: a dead engine thread or TP follower marks the replica unhealthy,
        and Serve replaces it."""
        await self.engine.health()  # raises EngineUnavailable when the loop died
        if self.followers is not None and (why := self.followers.failed()):
            raise RuntimeError(why)

    async def check_kv_accounting(self) -> dict[str, Any]:
        """Invariant 4 on this replica once it is idle (tests and operators: no leaked KV page)."""
        return await self.engine.check_kv_accounting()

    def __del__(self) -> None:
        # Serve calls this when it stops the replica: abort what runs, release the followers.
        if getattr(self, "pusher", None) is not None:
            self.pusher.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "followers", None) is not None:
            self.followers.kill()
