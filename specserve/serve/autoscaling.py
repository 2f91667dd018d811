"""The engine deployment's autoscaling policy: replicas from engine load, not only ongoing requests.

Each replica reports `LoadReport` figures through Ray Serve's `record_autoscaling_stats` hook; the
controller averages them over its look-back window and calls the policy (`EngineLoadPolicy`, around
`engine_load_policy`) with one value per replica. Ongoing requests alone miss what makes an LLM
replica slow: a deep waiting queue (admitted but not yet running), a KV cache near full
(retractions, recompute) and a rising time to first token.
The policy asks for as many replicas as the most loaded signal needs; Serve then applies the
configured bounds, scaling factors and up/down delays.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

# Metric names a replica reports (keys of `LoadReport.as_metrics()`).
WAITING, RUNNING, KV_USAGE, TTFT = "waiting", "running", "kv_usage", "ttft_s"
PUBLISH_EVERY_S = 2.0  # an unchanged decision is re-sent this often (a restarted hub learns it again)

log = logging.getLogger("specserve.serve")


@dataclass(frozen=True)
class LoadReport:
    """One replica's load, as its engine sees it."""

    running: int
    waiting: int
    kv_usage: float  # used / total KV pages
    ttft_s: float  # recent mean time to first token (0 when none finished lately)

    def as_metrics(self) -> dict[str, float]:
        names = {"running": RUNNING, "waiting": WAITING, "kv_usage": KV_USAGE, "ttft_s": TTFT}
        return {names[k]: float(v) for k, v in asdict(self).items()}


def replicas_needed(
    current: int,
    ongoing_requests: float,
    per_replica: dict[str, list[float]],
    *,
    target_ongoing_requests: float,
    target_queue_depth: float,
    target_kv_usage: float,
    target_ttft_s: float | None,
) -> float:
    """The replica count each signal asks for, and the largest of them.

    Ongoing requests are a total (Serve counts them at the handles); the engine signals are per-replica
    means, so a replica count that brings each mean back to its target is current × mean / target.
    """
    current = max(current, 1)
    wants = [ongoing_requests / target_ongoing_requests]
    wants.append(current * _mean(per_replica.get(WAITING, ())) / target_queue_depth)
    wants.append(current * _mean(per_replica.get(KV_USAGE, ())) / target_kv_usage)
    if target_ttft_s is not None:
        wants.append(current * _mean(per_replica.get(TTFT, ())) / target_ttft_s)
    return max(wants)


def engine_load_policy(
    ctx: Any,
    target_ongoing_requests: float = 16.0,
    target_queue_depth: float = 4.0,
    target_kv_usage: float = 0.8,
    target_ttft_s: float | None = None,
) -> tuple[int, dict[str, Any]]:
    """The decision: `AutoscalingContext` in, desired replicas and policy state out."""
    metrics = ctx.aggregated_metrics or {}
    per_replica = {name: list(values.values()) for name, values in metrics.items()}
    wanted = replicas_needed(
        ctx.current_num_replicas,
        float(ctx.total_num_requests or 0.0),
        per_replica,
        target_ongoing_requests=target_ongoing_requests,
        target_queue_depth=target_queue_depth,
        target_kv_usage=target_kv_usage,
        target_ttft_s=target_ttft_s,
    )
    low, high = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
    desired = min(max(math.ceil(wanted - 1e-9), low), high)
    state = dict(ctx.policy_state or {})
    state["specserve_wanted_replicas"] = wanted
    return desired, state


class EngineLoadPolicy:
    """`engine_load_policy` as Ray Serve runs it (`specserve.serve.autoscaling:EngineLoadPolicy`): a
    class, because Serve passes `policy_kwargs` only to a class policy's constructor (a function policy
    would run with its defaults, whatever the config says). One instance per deployment, called every
    control-loop tick; it also publishes each decision to the app's metrics hub as
    `specserve_autoscaling_target_replicas`."""

    def __init__(self, model_name: str | None = None, **targets: Any) -> None:
        self.model_name = model_name
        self.targets = targets  # engine_load_policy's keyword arguments
        self._sent: tuple[int | None, float] = (None, 0.0)  # (replicas, monotonic time) last published

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        desired, state = engine_load_policy(ctx, **self.targets)
        self._publish(getattr(ctx, "app_name", None), desired)
        return desired, state

    def _publish(self, app_name: str | None, desired: int) -> None:
        """Best effort and rate-limited: the controller loop must never fail or stall on metrics (the
        send itself is fire and forget)."""
        now = time.monotonic()
        sent, at = self._sent
        if app_name is None or self.model_name is None or (sent == desired and now - at < PUBLISH_EVERY_S):
            return
        self._sent = (desired, now)
        try:
            from specserve.serve.metrics_hub import get_hub

            get_hub(app_name).set_target.remote(self.model_name, desired)
        except Exception as err:
            log.warning("publishing the autoscaling target failed: %r", err)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
