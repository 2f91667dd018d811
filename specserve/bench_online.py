"""`specserve bench online`: latency and throughput of a running server under bounded load.

Prompts come from the same data sets as the offline bench; the load shape, bounds and outcome classes
are `specserve.bench_load`'s. The report gives TTFT, inter-token latency (per streamed chunk), time per
output token and end-to-end latency (mean, p50/p90/p99, max, over the `ok` requests), request and
output-token throughput, and a count per outcome; JSON and a table, like the offline bench.

Loopback only by default: this is a load generator, and pointed at someone else's server it is a
denial-of-service tool. `--allow-remote` is for a server you run on another host.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import socket
import sys
from typing import Any
from urllib.parse import urlsplit

import httpx

from specserve.bench_data import add_dataset_arguments, prompt_texts
from specserve.bench_load import (
    ENDPOINTS,
    OUTCOMES,
    Generation,
    LoadResult,
    LoadShape,
    RequestRecord,
    run_load,
)
from specserve.bench_report import format_table, run_info, write_json
from specserve.bench_stats import summarize

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_CONCURRENCY = 8


class RemoteTargetError(ValueError):
    """The URL's host is not (only) this machine and remote targets were not allowed."""


def require_loopback(url: str) -> None:
    """Raise unless `url` is http(s) and every address its host resolves to is a loopback address."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RemoteTargetError(f"--url: {url!r} is not an http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as err:
        raise RemoteTargetError(f"--url: cannot resolve {parts.hostname!r}: {err}") from None
    remote = sorted({info[4][0] for info in infos if not _is_loopback(info[4][0])})
    if remote:
        raise RemoteTargetError(
            f"--url: {parts.hostname} resolves to {', '.join(remote)}, not a loopback address. "
            "This is a load generator, so it only targets this machine unless told otherwise: "
            "pass --allow-remote to load a server you operate."
        )


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_URL, help="the server (loopback only without --allow-remote)"
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a URL that is not this machine (only for a server you operate)",
    )
    parser.add_argument(
        "--endpoint",
        default="generate",
        choices=sorted(ENDPOINTS),
        help="generate: native streaming /generate; completions, chat: OpenAI streaming",
    )
    load = parser.add_argument_group("load shape (bounded by --num-requests and --max-seconds)")
    load.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help=f"requests in flight (closed loop; default {DEFAULT_CONCURRENCY}); "
        "with --request-rate, a cap on requests in flight",
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (seeded by --seed)"
    )
    load.add_argument("--num-requests", type=int, default=200, help="requests to send at most")
    load.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="wall-time limit: nothing is sent after it, and what is in flight is cut (a timeout)",
    )
    load.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        help="seconds without a byte before a request times out",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    parser.add_argument(
        "--model", default=None, help="the OpenAI `model` field (default: the server's model)"
    )
    add_dataset_arguments(parser)
    parser.add_argument("--out", default="bench_online.json", help="where to write the JSON results")


def run(args: argparse.Namespace) -> int:
    try:
        if not args.allow_remote:
            require_loopback(args.url)
        concurrency = args.concurrency
        if concurrency is None and args.request_rate is None:
            concurrency = DEFAULT_CONCURRENCY
        shape = LoadShape(args.num_requests, args.max_seconds, concurrency, args.request_rate, args.seed)
        prompts = prompt_texts(args.dataset, seed=args.seed, max_chars=args.max_prompt_chars)
        if not prompts:
            raise ValueError(f"--max-prompt-chars: no {args.dataset} prompt is that short")
    except ValueError as err:
        print(f"specserve bench online: error: {err}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    try:
        served = _served_model(url)
    except httpx.HTTPError as err:
        print(f"specserve bench online: error: cannot reach {url}: {err}", file=sys.stderr)
        return 1
    gen = Generation(args.max_new_tokens, args.ignore_eos, args.model)
    result = asyncio.run(run_load(url, ENDPOINTS[args.endpoint], prompts, shape, gen, args.request_timeout))
    report = {
        "mode": "online",
        **run_info(getattr(args, "argv", sys.argv[1:])),
        "url": url,
        "endpoint": args.endpoint,
        "served_model": served,
        "dataset": args.dataset,
        "load": {
            "concurrency": shape.concurrency,
            "request_rate": shape.request_rate,
            "num_requests": shape.num_requests,
            "max_seconds": shape.max_seconds,
            "seed": shape.seed,
        },
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        **summarize_load(result),
    }
    write_json(args.out, report)
    print(render(report))
    return 0


def _served_model(url: str) -> str | None:
    """The served model's id from `/v1/models` (None if the server has no such route); also a check
    that the server answers at all before any load is sent."""
    r = httpx.get(f"{url}/v1/models", timeout=30, trust_env=False)
    if r.status_code != 200:
        return None
    data = r.json().get("data") or [{}]
    return data[0].get("id")


def summarize_load(result: LoadResult) -> dict[str, Any]:
    """Counts per outcome, throughput, and latency summaries (seconds) over the ok requests."""
    ok = [r for r in result.records if r.outcome == "ok"]
    outcomes = {name: 0 for name in OUTCOMES}
    for record in result.records:
        outcomes[record.outcome] += 1
    latencies = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "tpot": [
            (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
            for r in ok
            if r.output_tokens > 1 and r.ttft_s is not None
        ],
        "e2e": [r.e2e_s for r in ok],
    }
    duration = result.duration_s
    tokens = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration,
        "sent": len(result.records),
        "not_sent": result.not_sent,
        "outcomes": outcomes,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "latency_s": {
            name: (s.as_dict() if (s := summarize(values)) else None) for name, values in latencies.items()
        },
        "requests": [_record_dict(r) for r in result.records],
    }


def _record_dict(record: RequestRecord) -> dict[str, Any]:
    """A request in the JSON: its inter-token gaps are in the ITL summary, not repeated here."""
    return {
        "index": record.index,
        "outcome": record.outcome,
        "status": record.status,
        "start_s": record.start_s,
        "ttft_s": record.ttft_s,
        "e2e_s": record.e2e_s,
        "output_tokens": record.output_tokens,
        "chunks": len(record.itl_s) + 1 if record.ttft_s is not None else 0,
        "error": record.error,
    }


def _describe_load(load: dict[str, Any]) -> str:
    if load["request_rate"] is None:
        return f"concurrency {load['concurrency']}"
    cap = f", at most {load['concurrency']} in flight" if load["concurrency"] else ""
    return f"Poisson {load['request_rate']}/s{cap}"


def render(report: dict[str, Any]) -> str:
    """The printed summary: outcomes, throughput, and a latency table in milliseconds."""
    shape = _describe_load(report["load"])
    counts = ", ".join(f"{name} {n}" for name, n in report["outcomes"].items() if n)
    lines = [
        f"{report['endpoint']} at {report['url']}, {shape}: {report['sent']} sent, {report['not_sent']} not sent "
        f"in {report['duration_s']:.1f} s",
        f"outcomes: {counts or 'none'}",
        f"throughput: {report['request_throughput']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s",
    ]
    rows = []
    for name, s in report["latency_s"].items():
        if s is not None:
            rows.append(
                [name, str(s["count"]), *(f"{1000 * s[k]:.1f}" for k in ("mean", "p50", "p90", "p99", "max"))]
            )
    if rows:
        lines.append(format_table(["latency (ms)", "n", "mean", "p50", "p90", "p99", "max"], rows))
    return "\n".join(lines)
