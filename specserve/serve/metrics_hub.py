"""The metrics hub: one small named actor per Serve app holding the latest metrics of its replicas, so
that one scrape of any ingress replica's `/metrics` returns every replica's (each labelled by its id).

Engine and ingress replicas push their exposition text every `metrics_push_interval_s`
(`MetricsPusher`, an asyncio task on the replica's event loop) and take it back when they stop; the
autoscaling policy pushes its decision; an ingress's `/metrics` asks for everything (`HubReader`). A
replica silent for `STALE_AFTER_S` is dropped, so `specserve_replica_up` counts the live engine replicas.

The hub is detached (a replica that created it may be scaled away) and found by name
(`get_if_exists`), in its own namespace whatever the caller's job. It outlives `serve.delete` as one
idle actor per app name, which a redeploy under that name reuses (`kill_hub` removes it; `specserve
serve` does on exit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from specserve.api.client import EngineUnavailable
from specserve.metrics import fleet_exposition, merge_expositions

log = logging.getLogger("specserve.serve")

HUB_NAMESPACE = "specserve"
STALE_AFTER_S = 30.0
CALL_TIMEOUT_S = 10.0  # a wedged hub must not hang a scrape or pile up pushes


@dataclass
class _Report:
    model: str
    text: str
    engine: bool  # an engine replica (counted by specserve_replica_up), else an ingress replica
    at: float


@ray.remote(num_cpus=0)
class MetricsHub:
    """Latest exposition per replica of one app. Async methods without awaits: each runs whole on the
    actor's event loop, so no locks are needed."""

    def __init__(self) -> None:
        self._reports: dict[str, _Report] = {}
        self._targets: dict[str, int] = {}  # model -> replicas the autoscaling policy asked for

    async def push(self, replica: str, model: str, text: str, engine: bool = True) -> None:
        self._reports[replica] = _Report(model, text, engine, time.monotonic())

    async def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    async def set_target(self, model: str, replicas: int) -> None:
        self._targets[model] = replicas

    async def texts(self) -> list[str]:
        """Every live replica's text, and the fleet gauges."""
        now = time.monotonic()
        for replica in [r for r, rep in self._reports.items() if now - rep.at > STALE_AFTER_S]:
            del self._reports[replica]
        up = [(rep.model, replica) for replica, rep in self._reports.items() if rep.engine]
        return [rep.text for rep in self._reports.values()] + [fleet_exposition(up, self._targets)]


def _hub_name(app_name: str) -> str:
    return f"metrics-hub:{app_name}"


def get_hub(app_name: str) -> Any:
    """The hub of `app_name`, created by whoever asks first (a blocking call to Ray's GCS)."""
    return MetricsHub.options(
        name=_hub_name(app_name),
        namespace=HUB_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
    ).remote()


def kill_hub(app_name: str) -> None:
    """Remove `app_name`'s hub, if there is one (after `serve.delete`, on a cluster that lives on)."""
    with contextlib.suppress(ValueError):  # none
        ray.kill(ray.get_actor(_hub_name(app_name), namespace=HUB_NAMESPACE))


def current_replica() -> tuple[str, str]:
    """(app name, replica id) of the Serve replica this code runs in."""
    context = serve.get_replica_context()
    return context.app_name, context.replica_id.unique_id


class _HubLink:
    """A cached hub handle, fetched off the event loop and dropped after a failed or timed-out call
    (the hub may have died; `get_if_exists` then makes a new one)."""

    def __init__(self, app_name: str) -> None:
        self.app_name = app_name
        self._hub: Any = None

    async def call(self, method: str, *args: Any) -> Any:
        if self._hub is None:
            self._hub = await asyncio.to_thread(get_hub, self.app_name)
        try:
            return await asyncio.wait_for(getattr(self._hub, method).remote(*args), CALL_TIMEOUT_S)
        except Exception:
            self._hub = None
            raise

    def call_nowait(self, method: str, *args: Any) -> None:
        """Fire and forget, through the cached handle only (for shutdown paths, which must not block)."""
        if self._hub is not None:
            with contextlib.suppress(Exception):
                getattr(self._hub, method).remote(*args)


class MetricsPusher:
    """Pushes one replica's exposition (`text()`) to its app's hub every `interval_s`; best effort: a
    failed push is logged and retried at the next tick."""

    def __init__(self, model: str, text: Callable[[], str], interval_s: float, engine: bool = True) -> None:
        app_name, self.replica = current_replica()
        self._link = _HubLink(app_name)
        self._args = (model, engine)
        self._text, self._interval_s = text, interval_s
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    async def push(self) -> None:
        model, engine = self._args
        await self._link.call("push", self.replica, model, self._text(), engine)

    async def _run(self) -> None:
        while True:
            try:
                await self.push()
            except Exception as err:  # metrics must never take a replica down
                log.warning("pushing metrics to the hub failed: %r", err)
            await asyncio.sleep(self._interval_s)

    def stop(self) -> None:
        """Stop pushing and take this replica's figures out of the hub now (not 30 s later). Any
        thread may call it (Serve may run a replica's `__del__` off its event loop)."""
        with contextlib.suppress(RuntimeError):  # the loop is already closed: so is the task
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._link.call_nowait("forget", self.replica)


class HubReader:
    """What an ingress's `/metrics` returns besides its own live HTTP counts: the app's whole fleet."""

    def __init__(self, app_name: str) -> None:
        self._link = _HubLink(app_name)

    async def text(self) -> str:
        try:
            texts = await self._link.call("texts")
        except Exception as err:  # a failed scrape (503) beats one silently missing every engine
            raise EngineUnavailable(f"the metrics hub is unreachable: {type(err).__name__}") from err
        return merge_expositions(texts)
