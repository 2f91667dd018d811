"""`specserve bench online`: the maths (percentiles, Poisson arrivals), the loopback guard, how each
kind of response is classified (over a mock transport), and real runs against the FastAPI app over an
in-process engine served by uvicorn on a loopback port. The 500-request hardening run against the Ray
Serve app is in tests/test_serve_ray.py (it shares that file's Ray instance)."""

from __future__ import annotations

import asyncio
import json
import statistics

import httpx
import numpy as np
import pytest

from specserve.api.app import make_app
from specserve.bench_load import (
    ENDPOINTS,
    OUTCOMES,
    Generation,
    LoadShape,
    poisson_arrivals,
    send_one,
)
from specserve.bench_online import RemoteTargetError, require_loopback
from specserve.bench_stats import percentile, summarize
from specserve.cli import main

from api_utils import async_engine
from prometheus_utils import uvicorn_thread

# ---------------------------------------------------------------------------------------------- maths


def test_percentiles_match_numpy_linear():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.exponential(size=n).tolist()
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_summary():
    s = summarize([0.1, 0.2, 0.3, 0.4])
    assert (s.count, s.max) == (4, 0.4) and s.mean == pytest.approx(0.25) and s.p50 == pytest.approx(0.25)
    assert s.p99 == pytest.approx(0.397) and summarize([]) is None


def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    times = poisson_arrivals(20.0, 4000, seed=7)
    assert times == poisson_arrivals(20.0, 4000, seed=7) and times != poisson_arrivals(20.0, 4000, seed=8)
    assert len(times) == 4000 and all(b > a for a, b in zip(times, times[1:], strict=False))
    gaps = np.diff([0.0, *times])
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)  # exponential: mean = sd = 1/rate
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.1)
    with pytest.raises(ValueError, match="request_rate"):
        poisson_arrivals(0, 3, seed=0)


def test_load_shape_is_always_bounded():
    with pytest.raises(ValueError, match="num_requests"):
        LoadShape(num_requests=0, max_seconds=10, concurrency=1)
    with pytest.raises(ValueError, match="max_seconds"):
        LoadShape(num_requests=5, max_seconds=0, concurrency=1)
    with pytest.raises(ValueError, match="concurrency"):
        LoadShape(num_requests=5, max_seconds=10)


# ---------------------------------------------------------------------------------------------- guard


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://127.3.4.5:1/x", "http://localhost:8000", "https://[::1]:8443"]
)
def test_loopback_urls_pass(url):
    require_loopback(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://192.0.2.7:8000", "not a loopback"),  # TEST-NET-1: never routed, never resolved
        ("http://[2001:db8::1]:8000", "not a loopback"),
        ("ftp://127.0.0.1/", "not an http"),
        ("127.0.0.1:8000", "not an http"),
        ("http://127.0.0.1:notaport", "cannot resolve"),
    ],
)
def test_other_urls_are_refused(url, why):
    with pytest.raises(RemoteTargetError, match=why):
        require_loopback(url)


def test_cli_refuses_a_remote_url_before_sending_anything(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert main(["bench", "online", "--url", "http://192.0.2.7:8000", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--allow-remote" in err and "load generator" in err and not out.exists()


# ------------------------------------------------------------------------------ outcome classification


def _sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _native(tokens: int, finished: bool = False) -> dict:
    reason = {"type": "length"} if finished else None
    return {"text": "x" * tokens, "meta_info": {"completion_tokens": tokens, "finish_reason": reason}}


RESPONSES = {
    "ok": (200, _sse(_native(1), _native(3), _native(4, True), "[DONE]")),
    "http_429": (429, b'{"error": {"code": 429}}'),
    "http_503": (503, b'{"error": {"code": 503}}'),
    "http_4xx": (400, b'{"error": {"code": 400}}'),
    "http_5xx": (500, b"boom"),
    "in-band 503": (200, _sse(_native(1), {"error": {"message": "gone", "code": 503}}, "[DONE]")),
    "in-band 500": (200, _sse({"error": {"message": "bug", "code": 500}}, "[DONE]")),
    "truncated": (200, _sse(_native(1), _native(2))),
    "no finish": (200, _sse(_native(1), "[DONE]")),
    "malformed": (200, b"data: {not json\n\n"),
}
EXPECTED = {
    "ok": "ok",
    "http_429": "http_429",
    "http_503": "http_503",
    "http_4xx": "http_4xx",
    "http_5xx": "http_5xx",
    "in-band 503": "http_503",
    "in-band 500": "http_5xx",
    "truncated": "lost",
    "no finish": "lost",
    "malformed": "transport_error",
}


@pytest.mark.parametrize("case", list(RESPONSES))
def test_each_response_gets_one_outcome(case):
    status, content = RESPONSES[case]
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=content))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_one(client, "http://t", ENDPOINTS["generate"], "hi", Generation(4), 3, 0.0)

    record = asyncio.run(go())
    assert record.outcome == EXPECTED[case] and record.index == 3
    if case == "ok":
        assert record.output_tokens == 4 and len(record.itl_s) == 2 and 0 <= record.ttft_s <= record.e2e_s


def test_refused_connection_is_a_transport_error():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
            return await send_one(client, "http://t", ENDPOINTS["chat"], "hi", Generation(4), 0, 0.0)

    assert asyncio.run(go()).outcome == "transport_error"


# ----------------------------------------------------------------------------- against a real server


@pytest.fixture(scope="module")
def server(tiny_llama):
    """The HTTP app over an in-process engine, behind uvicorn: small queues, so load can overflow."""
    with (
        async_engine(tiny_llama, max_queued_requests=4, max_running_requests=4) as client,
        uvicorn_thread(make_app(client)) as url,
    ):
        yield url, client


@pytest.fixture(autouse=True)
def _idle(request):
    yield
    if "server" in request.fixturenames:
        assert request.getfixturevalue("server")[1].wait_idle(60), "the engine thread did not go idle"


def _bench(url: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "online.json"
    argv = ["bench", "online", "--url", url, "--max-new-tokens", "4", "--ignore-eos", "--out", str(out)]
    assert main([*argv, *flags]) == 0
    return json.loads(out.read_text())


def _check_accounting(report: dict, num_requests: int) -> None:
    """Every request sent has exactly one outcome, and sent + not sent is what was asked for."""
    assert report["sent"] + report["not_sent"] == num_requests
    assert sum(report["outcomes"].values()) == report["sent"] == len(report["requests"])
    assert set(report["outcomes"]) == set(OUTCOMES)
    assert sorted(r["index"] for r in report["requests"]) == list(range(report["sent"]))


@pytest.mark.parametrize("endpoint", ["generate", "completions", "chat"])
def test_closed_loop_run_reports_latencies(server, tmp_path, capsys, endpoint):
    url, _ = server
    report = _bench(url, tmp_path, "--endpoint", endpoint, "--num-requests", "10", "--concurrency", "2")
    _check_accounting(report, 10)
    assert report["outcomes"]["ok"] == 10 and report["not_sent"] == 0
    assert report["served_model"] == "tiny" and report["endpoint"] == endpoint
    assert report["load"] == {
        "concurrency": 2, "request_rate": None, "num_requests": 10, "max_seconds": 600.0, "seed": 0
    }  # fmt: skip
    assert report["output_tokens"] == 40 and report["output_tokens_per_s"] > 0
    assert report["command"].startswith("specserve bench online --url http://127.0.0.1:")
    latency = report["latency_s"]
    assert latency["ttft"]["count"] == latency["e2e"]["count"] == 10
    assert latency["itl"]["count"] >= 10 and latency["tpot"]["count"] == 10
    for s in latency.values():
        assert 0 <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert all(r["output_tokens"] == 4 and r["ttft_s"] <= r["e2e_s"] for r in report["requests"])
    printed = capsys.readouterr().out
    assert "outcomes: ok 10" in printed and "ttft" in printed and "p99" in printed


def test_poisson_arrivals_overflowing_small_queues(server, tmp_path):
    """All 24 at once overflow 4 running + 4 queued: each one still ends as ok or a clean 429."""
    url, _ = server
    report = _bench(url, tmp_path, "--request-rate", "1000", "--num-requests", "24", "--seed", "3")
    _check_accounting(report, 24)
    assert report["outcomes"]["ok"] + report["outcomes"]["http_429"] == 24 and report["outcomes"]["ok"] >= 4
    assert report["load"]["request_rate"] == 1000 and report["load"]["concurrency"] is None


def test_time_limit_stops_the_run(server, tmp_path):
    url, _ = server
    report = _bench(url, tmp_path, "--num-requests", "100000", "--max-seconds", "1", "--concurrency", "2")
    _check_accounting(report, 100000)
    assert report["not_sent"] > 0 and report["outcomes"]["ok"] >= 1
    assert set(k for k, n in report["outcomes"].items() if n) <= {"ok", "timeout"}
