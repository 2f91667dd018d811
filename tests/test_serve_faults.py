"""Faults through a real Ray Serve deployment (CPU, a tiny model at TP=2 over gloo, two ingress
replicas): clients that hang up at random points leave no KV page behind; idle TP followers outlive
the step timeout; a killed ingress replica costs a client at most a retry; a killed TP follower fails
its replica's in-flight requests with a 503 within seconds, Serve replaces the replica, new requests
succeed, and no follower or placement group is left behind. Timings are printed, never asserted
(beyond generous hang guards)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.exceptions import RayTaskError  # noqa: E402

from specserve.api.client import EngineStepError, EngineUnavailable  # noqa: E402
from specserve.serve.handle_client import translate  # noqa: E402
from specserve.serve.metrics_hub import kill_hub  # noqa: E402
from specserve.serve.placement import FOLLOWER_NAMESPACE  # noqa: E402

from serve_utils import INGRESS, deploy, engine, kv_clean, running_replicas  # noqa: E402
from tiny_models import save_tiny_llama3  # noqa: E402

pytestmark = pytest.mark.timeout(600)

APP, ROUTE = "faults", "/faults"
TP_TIMEOUT_S = 4.0  # a collective waits this long for a rank; idle followers are pinged every 1 s
LONG = {"max_new_tokens": 480, "ignore_eos": True}  # seconds of decoding: in flight when the fault hits
HANG_GUARD_S = 60.0


def test_a_failed_engine_step_behind_ray_is_a_503():
    """The error a replica's failed step raises reaches the ingress wrapped by Ray; it must come out as
    the EngineUnavailable it is (a 503), never as an unknown error (a 500)."""
    wrapped = RayTaskError("generate", "traceback", EngineStepError("engine step failed: boom"))
    error = translate(wrapped.as_instanceof_cause())
    assert isinstance(error, EngineStepError) and isinstance(error, EngineUnavailable)


@pytest.fixture(scope="module")
def url(ray_serve_url, smollm2_gguf, tmp_path_factory):
    from specserve.model.tokenizer import load_tokenizer

    folder = save_tiny_llama3(tmp_path_factory.mktemp("faults") / "model", load_tokenizer(smollm2_gguf))
    deploy(
        APP,
        ROUTE,
        model=str(folder),
        speculative=None,
        tp_size=2,
        ingress_replicas=2,
        tp_timeout_s=TP_TIMEOUT_S,
        health_check_period_s=1.0,
    )
    yield f"{ray_serve_url}{ROUTE}"
    serve.delete(APP)
    kill_hub(APP)
    deadline = time.monotonic() + HANG_GUARD_S
    while _followers() or _placement_groups():  # both go with the deleted replicas
        assert time.monotonic() < deadline, (_followers(), _placement_groups())
        time.sleep(0.5)


def _followers() -> list[str]:
    """Names of the live TP follower actors of this app's replicas."""
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(
        a["name"]
        for a in named
        if a["namespace"] == FOLLOWER_NAMESPACE and a["name"].startswith("tp-follower:")
    )


def _placement_groups() -> list[str]:
    table = ray.util.placement_group_table().values()
    return sorted(pg["name"] for pg in table if pg["state"] != "REMOVED" and f"{APP}#" in pg["name"])


def _ingress_actors() -> list[str]:
    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["name"].startswith(f"SERVE_REPLICA::{APP}#{INGRESS}#"))


def _health() -> dict:
    return engine(APP).health.remote().result(timeout_s=HANG_GUARD_S)


def _wait_idle() -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while (load := _health())["num_running"] or load["num_waiting"]:
        assert time.monotonic() < deadline, f"requests kept running after their clients left: {load}"
        time.sleep(0.2)


def test_replicas_run_this_tree(url):
    """The replicas import the code under test (the new ServeConfig fields would fail any other), and
    each engine replica has its TP follower."""
    assert _health()["replica"] and len(_followers()) == 1 and len(_placement_groups()) == 1


def test_clients_leaving_at_random_points_leave_no_kv_behind(url):
    rng = random.Random(1234)
    plans = [
        rng.choice(["before headers", "mid stream", "mid stream", "gives up", "stays"]) for _ in range(24)
    ]
    outcomes: dict[str, int] = {}

    async def client(i: int, plan: str, http: httpx.AsyncClient) -> None:
        body = {"input_ids": [5 + i, 6, 7], "sampling_params": LONG, "stream": plan != "gives up"}
        if plan == "stays":
            body["sampling_params"] = {"max_new_tokens": 16}
        if plan in ("before headers", "gives up"):  # hangs up while waiting for the response
            with contextlib.suppress(TimeoutError, httpx.TimeoutException):
                await asyncio.wait_for(http.post(f"{url}/generate", json=body), rng.uniform(0.05, 1.0))
        else:
            async with http.stream("POST", f"{url}/generate", json=body) as response:
                assert response.status_code == 200
                leave_after = rng.randint(1, 12) if plan == "mid stream" else None
                frames, last = 0, None
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        frames, last = frames + 1, line
                    if frames == leave_after:
                        break
                if plan == "stays":
                    assert last == "data: [DONE]"
        outcomes[plan] = outcomes.get(plan, 0) + 1

    async def run_all() -> None:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
            await asyncio.gather(*(client(i, plan, http) for i, plan in enumerate(plans)))

    start = time.monotonic()
    asyncio.run(run_all())
    _wait_idle()
    print(
        f"\n{len(plans)} clients {outcomes}: engine idle {time.monotonic() - start:.1f} s after they started"
    )
    kv_clean(APP)


def test_idle_tp_followers_outlive_the_step_timeout(url):
    """A follower waits for the next step in a collective bounded by the step timeout: while idle, rank
    0's pings keep it waiting, so an idle replica does not fail."""
    before = _health()["replica"]
    time.sleep(TP_TIMEOUT_S * 1.5)
    response = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7]}, timeout=HANG_GUARD_S)
    assert response.status_code == 200, response.text
    assert _health()["replica"] == before and len(_followers()) == 1


def _post_with_retries(url: str, body: dict, attempts: int = 6) -> tuple[httpx.Response, int]:
    """What a client with a simple retry policy does: retry a 5xx or a dropped connection, with backoff."""
    for attempt in range(1, attempts + 1):
        try:
            response = httpx.post(url, json=body, timeout=HANG_GUARD_S)
            if response.status_code < 500 or attempt == attempts:
                return response, attempt
        except httpx.TransportError:
            if attempt == attempts:
                raise
        time.sleep(0.25 * 2**attempt)
    raise AssertionError("unreachable")


def test_a_killed_ingress_replica_is_replaced_and_clients_with_a_retry_succeed(url):
    ingress = _ingress_actors()
    assert len(ingress) == 2, ingress
    ray.kill(ray.get_actor(ingress[0], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    attempts = []
    for i in range(20):
        response, tries = _post_with_retries(
            f"{url}/generate", {"input_ids": [9, i + 1], "sampling_params": {"max_new_tokens": 4}}
        )
        assert response.status_code == 200, response.text
        attempts.append(tries)
    deadline = time.monotonic() + HANG_GUARD_S
    while running_replicas(APP, INGRESS) < 2 or ingress[0] in _ingress_actors():
        assert time.monotonic() < deadline, "Serve did not replace the killed ingress replica"
        time.sleep(0.5)
    print(
        f"\ningress replica killed: 20 requests, {sum(t > 1 for t in attempts)} retried "
        f"({max(attempts)} attempts at most); replaced after {time.monotonic() - killed:.1f} s"
    )


def test_a_killed_tp_follower_fails_its_requests_with_a_503_and_the_replica_is_replaced(url):
    replica = _health()["replica"]
    (follower,) = _followers()
    assert replica in follower

    async def in_flight() -> tuple[list[httpx.Response], list[dict], float]:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as http:
            plain = [
                asyncio.ensure_future(
                    http.post(f"{url}/generate", json={"input_ids": [5, i + 1], "sampling_params": LONG})
                )
                for i in range(3)
            ]
            body = {"input_ids": [7, 8], "sampling_params": LONG, "stream": True}
            async with http.stream("POST", f"{url}/generate", json=body) as stream:
                lines = aiter(stream.aiter_lines())
                while not (await anext(lines)).startswith("data:"):
                    pass  # the first chunk: every request is decoding now
                ray.kill(ray.get_actor(follower, namespace=FOLLOWER_NAMESPACE), no_restart=True)
                killed = time.monotonic()
                events = [json.loads(line[5:]) async for line in lines if line.startswith("data: {")]
            responses = await asyncio.gather(*plain)
            return responses, events, time.monotonic() - killed

    responses, events, failed_after = asyncio.run(asyncio.wait_for(in_flight(), HANG_GUARD_S))
    for response in responses:
        assert response.status_code == 503 and "Retry-After" in response.headers, response.text
        assert response.json()["error"]["type"] == "service_unavailable"
    assert events[-1]["error"]["code"] == 503, events[-1]  # the stream's failure, in-band
    messages = {r.json()["error"]["message"] for r in responses} | {events[-1]["error"]["message"]}
    start = time.monotonic()
    response, tries = _post_with_retries(
        f"{url}/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}, attempts=12
    )
    assert response.status_code == 200, response.text
    recovered_after = time.monotonic() - start
    new_replica = _health()["replica"]
    assert new_replica != replica
    deadline = time.monotonic() + HANG_GUARD_S
    while (followers := _followers()) != [follower.replace(replica, new_replica)] or len(
        _placement_groups()
    ) != 1:
        assert time.monotonic() < deadline, (followers, _placement_groups())  # the old ones are gone
        time.sleep(0.5)
    kv_clean(APP)
    print(
        f"\nTP follower killed: 4 in-flight requests failed with 503 within {failed_after:.2f} s "
        f"({sorted(messages)}); a client retrying {tries} times got a 200 after {recovered_after:.1f} s "
        f"from a new replica"
    )
