"""Where an engine replica's ranks run: one placement-group bundle per TP rank, packed on one node.

Ray Serve creates the group per replica from `placement_group_bundles` (STRICT_PACK: every rank on
the same node, so NCCL runs over NVLink / shared memory) and puts the replica actor, which is rank 0,
in bundle 0. Ranks 1..N-1 are `TPFollower` actors pinned to bundles 1..N-1; each runs the follower
loop until rank 0 shuts the group down. Rank 0 picks the rendezvous address (a free port on its
node) and hands it to the followers it starts: no fixed port anywhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from specserve.serve.config import ServeConfig


def uses_gpu(config: ServeConfig) -> bool:
    """Whether each rank takes a GPU: asked for, or `auto` on a cluster with enough GPUs."""
    if config.device.startswith("cuda"):
        return True
    if config.device == "cpu":
        return False
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= config.tp_size


def engine_deployment_options(config: ServeConfig, gpu: bool) -> dict[str, Any]:
    """Ray Serve options of the engine deployment: placement, replicas, bounded queues."""
    rank = {"CPU": config.cpus_per_rank, **({"GPU": 1} if gpu else {})}
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": config.cpus_per_rank, "num_gpus": 1 if gpu else 0},
        "placement_group_bundles": [dict(rank) for _ in range(config.tp_size)],
        "placement_group_strategy": "STRICT_PACK",
        # Calls a replica holds: every running and queued request plus control calls (health, stats).
        "max_ongoing_requests": config.max_running_requests + config.max_queued_requests + 8,
        # Calls the handles queue while every replica is full; beyond that, BackPressureError -> 503.
        "max_queued_requests": config.max_queued_requests,
        # A failed engine (dead TP follower, failed step) is replaced after 3 failed probes in a row.
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": 30,
        "graceful_shutdown_timeout_s": 10,
    }
    if config.autoscaling is not None:
        options["autoscaling_config"] = config.autoscaling.serve_config(config.model_name)
    else:
        options["num_replicas"] = config.num_replicas
    return options


def ingress_deployment_options(config: ServeConfig) -> dict[str, Any]:
    """The ingress holds every request the engines can hold, and then some: it only parses and streams,
    so Serve's default cap (5 per replica) would turn requests away long before the engines are busy."""
    per_engine = config.max_running_requests + config.max_queued_requests
    capacity = config.max_engine_replicas * per_engine // config.ingress_replicas
    return {"num_replicas": config.ingress_replicas, "max_ongoing_requests": max(256, 2 * capacity)}


@ray.remote
class TPFollower:
    """Rank r > 0 of a replica's TP group: runs the target model's shard in lockstep with rank 0."""

    def run(self, engine_config: Any, rank: int, size: int, address: str, timeout_s: float) -> int:
        from specserve.executor.follower import run_follower

        return run_follower(engine_config, rank, size, address, timeout_s)

    def ready(self) -> bool:
        return True


@dataclass
class FollowerGroup:
    """Ranks 1..N-1 of one replica, and the refs of their (long-running) follower loops."""

    actors: list[Any]
    loops: list[ray.ObjectRef]

    def failed(self) -> str | None:
        """Why a follower stopped (its loop ended or raised), or None while all run."""
        done, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as err:  # the actor died or its loop raised
                return _why(self.loops.index(ref) + 1, err)
            return _why(self.loops.index(ref) + 1)
        return None

    async def first_failure(self) -> str:
        """Wait until a follower stops (its actor dies, its loop raises or ends) and say why: Ray
        resolves a dead actor's pending call with an error within moments, so this is how rank 0
        learns of a death even while its own thread is blocked in a collective with that rank."""

        async def outcome(rank: int, ref: ray.ObjectRef) -> str:
            try:
                await ref
            except Exception as err:
                return _why(rank, err)
            return _why(rank)

        waits = [asyncio.ensure_future(outcome(r, ref)) for r, ref in enumerate(self.loops, start=1)]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return done.pop().result()
        finally:
            for wait in waits:
                wait.cancel()

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _why(rank: int, err: BaseException | None = None) -> str:
    if err is None:
        return f"TP follower rank {rank} stopped following"
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, BaseException):
        err = err.cause  # what the follower's loop raised, not Ray's wrapper
    first_line = (str(err).strip().splitlines() or [""])[0]  # Ray's actor errors run on for lines
    return f"TP follower rank {rank} failed: {type(err).__name__}: {first_line}"


FOLLOWER_NAMESPACE = "specserve"


def follower_name(replica_id: str, rank: int) -> str:
    """A follower's actor name (in FOLLOWER_NAMESPACE): operators and tests find a replica's ranks by it.
    The actor is still owned by its replica, so it dies with it (no orphan outlives a replica)."""
    return f"tp-follower:{replica_id}:rank{rank}"


def start_followers(
    config: ServeConfig, engine_config: Any, address: str, gpu: bool, replica_id: str
) -> FollowerGroup:
    """Start ranks 1..N-1 in bundles 1..N-1 of this replica's placement group."""
    group = get_current_placement_group()
    actors, loops = [], []
    for rank in range(1, config.tp_size):
        strategy = (
            PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
            if group is not None
            else None
        )
        actor = TPFollower.options(
            name=follower_name(replica_id, rank),
            namespace=FOLLOWER_NAMESPACE,
            num_cpus=config.cpus_per_rank,
            num_gpus=1 if gpu else 0,
            scheduling_strategy=strategy,
        ).remote()
        actors.append(actor)
        loops.append(actor.run.remote(engine_config, rank, config.tp_size, address, config.tp_timeout_s))
    return FollowerGroup(actors, loops)
