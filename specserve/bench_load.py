"""The bounded load generator behind `specserve bench online`: streamed requests, one record each.

Load is a closed loop (`concurrency` requests in flight, each followed at once by the next) or Poisson
arrivals at `request_rate` (seeded, optionally capped at `concurrency` in flight). Every run is
bounded twice: by a request count and by wall time. At the time limit nothing new is sent and what is
still in flight is cancelled (its connection closed, so the server aborts it) and recorded as a
timeout: the tool cannot run on, whatever the server does.

Each request streams (SSE) and ends in exactly one outcome:
`ok` (a finished stream ending in `[DONE]`), `http_429`, `http_503`, `http_4xx`, `http_5xx` (the
status, or the code of an error event sent in-band after the headers), `transport_error` (refused,
reset, a broken stream), `timeout` (no byte for `request_timeout_s`, or cut at the time limit), and
`lost`: a 200 stream that ended without a finish — a server bug this tool exists to catch.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

OUTCOMES = ("ok", "http_429", "http_503", "http_4xx", "http_5xx", "transport_error", "timeout", "lost")
_ERROR_TEXT = 300  # characters of an error body kept in a record


@dataclass(frozen=True)
class LoadShape:
    """How requests are issued: `request_rate` None is a closed loop of `concurrency`."""

    num_requests: int
    max_seconds: float
    concurrency: int | None = None
    request_rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests: must be >= 1")
        if not self.max_seconds > 0:
            raise ValueError("max_seconds: must be > 0")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency: must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request_rate: must be > 0")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("concurrency: give a concurrency, a request rate, or both")


@dataclass(frozen=True)
class Generation:
    """What each request asks for (greedy)."""

    max_new_tokens: int
    ignore_eos: bool = False
    model: str | None = None  # the OpenAI `model` field; None: the server's only model


@dataclass(frozen=True)
class RequestRecord:
    index: int
    outcome: str
    start_s: float  # when it was sent, since the run began
    status: int | None = None
    ttft_s: float | None = None  # to the first chunk that carried output
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: tuple[float, ...] = ()  # gaps between chunks that carried output (a chunk may hold several tokens)
    error: str | None = None


@dataclass(frozen=True)
class LoadResult:
    records: tuple[RequestRecord, ...]  # one per request sent, by index
    duration_s: float
    not_sent: int  # of num_requests, left unsent at the time limit


@dataclass(frozen=True)
class Progress:
    """What one streamed event says: output text/tokens in it, the token count so far if the event
    tells it, and whether the request finished."""

    has_output: bool
    tokens: int | None
    finished: bool


class Endpoint(Protocol):
    path: str

    def body(self, prompt: str, gen: Generation) -> dict[str, Any]: ...

    def progress(self, event: dict[str, Any], tokens_so_far: int) -> Progress: ...


class NativeGenerate:
    """`POST /generate` with `stream: true`: cumulative chunks whose `meta_info` counts the tokens."""

    path = "/generate"

    def body(self, prompt: str, gen: Generation) -> dict[str, Any]:
        params = {"max_new_tokens": gen.max_new_tokens, "temperature": 0, "ignore_eos": gen.ignore_eos}
        return {"text": prompt, "stream": True, "sampling_params": params}

    def progress(self, event: dict[str, Any], tokens_so_far: int) -> Progress:
        meta = event.get("meta_info") or {}
        tokens = int(meta.get("completion_tokens", tokens_so_far))
        return Progress(tokens > tokens_so_far, tokens, meta.get("finish_reason") is not None)


class _OpenAIStream:
    """OpenAI streaming: delta chunks, then a usage chunk (`stream_options.include_usage`)."""

    path = ""

    def body(self, prompt: str, gen: Generation) -> dict[str, Any]:
        body = {
            **self._prompt(prompt),
            "max_tokens": gen.max_new_tokens,
            "temperature": 0,
            "ignore_eos": gen.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        return body if gen.model is None else {**body, "model": gen.model}

    def progress(self, event: dict[str, Any], tokens_so_far: int) -> Progress:
        choices = event.get("choices") or []
        usage = event.get("usage")
        text = "".join(self._text(c) for c in choices)
        finished = any(c.get("finish_reason") for c in choices)
        # Chunks carry text, not token counts: count chunks with text until the usage chunk says.
        tokens = usage["completion_tokens"] if usage else tokens_so_far + bool(text)
        return Progress(bool(text), tokens, finished)

    def _prompt(self, prompt: str) -> dict[str, Any]:
        raise NotImplementedError

    def _text(self, choice: dict[str, Any]) -> str:
        raise NotImplementedError


class Completions(_OpenAIStream):
    path = "/v1/completions"

    def _prompt(self, prompt: str) -> dict[str, Any]:
        return {"prompt": prompt}

    def _text(self, choice: dict[str, Any]) -> str:
        return choice.get("text") or ""


class Chat(_OpenAIStream):
    """The prompt as one user message: the server applies the model's chat template."""

    path = "/v1/chat/completions"

    def _prompt(self, prompt: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": prompt}]}

    def _text(self, choice: dict[str, Any]) -> str:
        return (choice.get("delta") or {}).get("content") or ""


ENDPOINTS: dict[str, Endpoint] = {"generate": NativeGenerate(), "completions": Completions(), "chat": Chat()}


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of `count` requests arriving as a Poisson process of
    `rate` per second: exponential gaps from a seeded generator, so a run can be repeated."""
    if not rate > 0:
        raise ValueError("request_rate: must be > 0")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def status_outcome(status: int) -> str:
    if status == 429:
        return "http_429"
    if status == 503:
        return "http_503"
    return "http_5xx" if status >= 500 else "http_4xx"


@dataclass
class _Stream:
    """One request's progress while its stream is read."""

    start: float
    tokens: int = 0
    first: float | None = None
    last: float | None = None
    gaps: list[float] = field(default_factory=list)
    finished: bool = False
    done: bool = False  # `[DONE]` seen
    error: dict[str, Any] | None = None

    def event(self, progress: Progress, now: float) -> None:
        if progress.has_output:
            if self.first is None:
                self.first = now
            else:
                self.gaps.append(now - self.last)
            self.last = now
        if progress.tokens is not None:
            self.tokens = progress.tokens
        self.finished = self.finished or progress.finished


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    endpoint: Endpoint,
    prompt: str,
    gen: Generation,
    index: int,
    t0: float,
) -> RequestRecord:
    """Send one streamed request and classify how it ended (never raises but for cancellation)."""
    start = time.perf_counter()
    base = {"index": index, "start_s": start - t0}
    stream = _Stream(start)
    try:
        async with client.stream("POST", url + endpoint.path, json=endpoint.body(prompt, gen)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")[:_ERROR_TEXT]
                return RequestRecord(
                    outcome=status_outcome(r.status_code), status=r.status_code, error=text, **base
                )
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    stream.done = True
                    break
                event = json.loads(data)
                if "error" in event:  # the headers were sent already: the failure comes in-band
                    stream.error = event["error"] if isinstance(event["error"], dict) else {"message": event}
                    continue
                stream.event(endpoint.progress(event, stream.tokens), time.perf_counter())
    except httpx.TimeoutException as err:
        return RequestRecord(outcome="timeout", error=f"{type(err).__name__}: {err}", **base)
    except httpx.HTTPError as err:
        return RequestRecord(outcome="transport_error", error=f"{type(err).__name__}: {err}", **base)
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # an event that is not what it should be
        return RequestRecord(outcome="transport_error", error=f"malformed stream: {err!r}", **base)
    end = time.perf_counter()
    if stream.error is not None:
        code = stream.error.get("code")
        outcome = status_outcome(code if isinstance(code, int) else 500)
        return RequestRecord(outcome=outcome, status=200, error=str(stream.error)[:_ERROR_TEXT], **base)
    if not (stream.finished and stream.done):
        return RequestRecord(outcome="lost", status=200, error="the stream ended without a finish", **base)
    return RequestRecord(
        outcome="ok",
        status=200,
        ttft_s=None if stream.first is None else stream.first - start,
        e2e_s=end - start,
        output_tokens=stream.tokens,
        itl_s=tuple(stream.gaps),
        **base,
    )


async def run_load(
    url: str,
    endpoint: Endpoint,
    prompts: Sequence[str],
    shape: LoadShape,
    gen: Generation,
    request_timeout_s: float = 300.0,
) -> LoadResult:
    """Send `shape.num_requests` requests (prompt i is `prompts[i % len(prompts)]`), within
    `shape.max_seconds`; one record per request sent."""
    in_flight = shape.concurrency or shape.num_requests
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    timeout = httpx.Timeout(request_timeout_s, connect=min(request_timeout_s, 30.0))
    # trust_env=False: no proxy from the environment; a load test must reach the server it names.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        run = _Run(client, url.rstrip("/"), endpoint, prompts, shape, gen)
        return await run.go()


class _Run:
    """One bounded run: spawns request tasks, keeps their records, cuts what is left at the deadline."""

    def __init__(self, client, url, endpoint, prompts, shape: LoadShape, gen: Generation) -> None:
        self.client, self.url, self.endpoint, self.prompts = client, url, endpoint, prompts
        self.shape, self.gen = shape, gen
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + shape.max_seconds
        self.started: dict[int, float] = {}
        self.records: dict[int, RequestRecord] = {}
        self.tasks: set[asyncio.Task] = set()

    async def go(self) -> LoadResult:
        main = asyncio.ensure_future(self._closed() if self.shape.request_rate is None else self._open())
        await asyncio.wait({main}, timeout=self._left())
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self._left())
        for task in [main, *self.tasks]:  # the time limit: cancel whatever is still going
            task.cancel()
        await asyncio.gather(main, *self.tasks, return_exceptions=True)
        for i, start in self.started.items():  # defensive: `_one` records every request it starts
            self.records.setdefault(i, RequestRecord(i, "lost", start, error="no record"))
        records = tuple(self.records[i] for i in sorted(self.records))
        return LoadResult(records, time.perf_counter() - self.t0, self.shape.num_requests - len(records))

    def _left(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    async def _one(self, i: int) -> None:
        if time.perf_counter() >= self.deadline:
            return
        start = self.started[i] = time.perf_counter() - self.t0
        prompt = self.prompts[i % len(self.prompts)]
        try:
            record = await send_one(self.client, self.url, self.endpoint, prompt, self.gen, i, self.t0)
        except asyncio.CancelledError:
            self.records[i] = RequestRecord(i, "timeout", start, error="cut off at max_seconds")
            raise
        except Exception as err:  # a bug of this tool: still one outcome for the request
            record = RequestRecord(i, "lost", start, error=f"load tool error: {type(err).__name__}: {err}")
        self.records[i] = record

    async def _closed(self) -> None:
        indices = iter(range(self.shape.num_requests))  # shared: each index goes to one worker

        async def worker() -> None:
            for i in indices:
                if time.perf_counter() >= self.deadline:
                    return
                await self._one(i)

        await asyncio.gather(*(self._spawn(worker()) for _ in range(self.shape.concurrency)))

    async def _open(self) -> None:
        limit = asyncio.Semaphore(self.shape.concurrency) if self.shape.concurrency else None

        async def limited(i: int) -> None:
            if limit is None:
                return await self._one(i)
            async with limit:
                return await self._one(i)

        arrivals = poisson_arrivals(self.shape.request_rate, self.shape.num_requests, self.shape.seed)
        spawned = []
        for i, at in enumerate(arrivals):
            when = self.t0 + at
            if when >= self.deadline:
                break
            await asyncio.sleep(max(0.0, when - time.perf_counter()))
            spawned.append(self._spawn(limited(i)))
        await asyncio.gather(*spawned)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        return task
