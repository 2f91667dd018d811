"""Several engine requests behind one HTTP request (`n`, prompt lists, native batches).

`open_all` starts them and waits for each one's first output, so a refusal (bad input, overload)
surfaces before any response is sent and the requests already started are aborted. `merge`
interleaves the opened streams for SSE; `collect` runs them to the end for a JSON response.
Closing, cancelling or failing any of these aborts every request still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from starlette.requests import Request as HttpRequest

from specserve.api.client import EngineClient, Prompt
from specserve.api.errors import ApiError, bad_request
from specserve.types import RequestOutput, SamplingParams, TokenLogprobs

T = TypeVar("T")


@dataclass
class Job:
    prompt: Prompt
    params: SamplingParams
    request_id: str


@dataclass
class Opened:
    """A started request: its first output, and the iterator of the rest."""

    first: RequestOutput
    rest: AsyncIterator[RequestOutput]


@dataclass
class Finished:
    """A request run to the end: its last output and the logprobs of every output token."""

    output: RequestOutput
    logprobs: list[TokenLogprobs] = field(default_factory=list)


def with_field_errors(fields: Mapping[str, str | None], build: Callable[[], T]) -> T:
    """Run `build`; a "field: message" ValueError becomes a 400 naming the API's field."""
    try:
        return build()
    except ValueError as exc:
        raise bad_request(exc, fields) from exc


async def start(client: EngineClient, jobs: Sequence[Job], fields: Mapping[str, str | None]) -> list[Opened]:
    """`open_all`, with the engine's ValueErrors as 400s naming the API's fields."""
    try:
        return await open_all(client, jobs)
    except ValueError as exc:
        raise bad_request(exc, fields) from exc


async def open_all(client: EngineClient, jobs: Sequence[Job]) -> list[Opened]:
    gens = [client.generate(job.prompt, job.params, job.request_id) for job in jobs]
    tasks = [asyncio.ensure_future(anext(gen)) for gen in gens]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if failed:
            raise failed[0].exception()
        return [Opened(t.result(), gen) for t, gen in zip(tasks, gens, strict=True)]
    except BaseException:
        for task in tasks:  # cancelling a pending first output aborts its request
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for gen in gens:
            await _close(gen)
        raise


async def _close(gen: AsyncIterator[RequestOutput]) -> None:
    """Close a started stream (aborting its request); a client's iterator may lack `aclose`."""
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def merge(opened: Sequence[Opened]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) of every stream as outputs arrive, each stream's first output first. Outputs
    of one stream that arrived while the reader was busy come as one (`RequestOutput.then`)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rest: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in rest:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    live = [(i, o) for i, o in enumerate(opened) if not o.first.finished]
    tasks = [asyncio.ensure_future(pump(i, o.rest)) for i, o in live]
    try:
        for index, o in enumerate(opened):
            yield index, o.first
        remaining = len(tasks)
        while remaining:
            arrived = [await queue.get()]
            while not queue.empty():
                arrived.append(queue.get_nowait())
            outputs: dict[int, RequestOutput] = {}  # per stream, in order of arrival
            for index, item in arrived:
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    break
                else:
                    outputs[index] = outputs[index].then(item) if index in outputs else item
            for index, out in outputs.items():  # what came before an error goes out first
                yield index, out
            if isinstance(item, Exception):
                raise item
    finally:
        for task in tasks:  # synchronous, so it happens even inside a cancelled scope
            task.cancel()


async def collect(opened: Sequence[Opened]) -> list[Finished]:
    async def drain(o: Opened) -> Finished:
        done = Finished(o.first, list(o.first.delta_logprobs))
        async for out in o.rest:
            done.output = out
            done.logprobs.extend(out.delta_logprobs)
        return done

    tasks = [asyncio.ensure_future(drain(o)) for o in opened]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def until_disconnect(request: HttpRequest, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ApiError(499, "the client disconnected")  # nobody reads this response
        return task.result()
    finally:
        task.cancel()
        watcher.cancel()


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
