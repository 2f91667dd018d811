"""`AsyncEngine`: the `EngineClient` of one in-process `Engine`, its step loop in a background thread.

The engine is not thread-safe, so only the loop thread touches it. The asyncio side posts commands
(add, abort, flush, stop) to a thread-safe queue, which the thread drains between steps; each step's
outputs go back to the requests' asyncio queues through `loop.call_soon_threadsafe` (one call per
event loop per step). Tokenisation and chat templating happen in the thread, so the event loop never
runs tokenizer code. A step that raises fails the requests it may have touched and the loop goes on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specserve.api.client import ChatPrompt, EngineOverloaded, EngineUnavailable, ModelInfo, Prompt
from specserve.engine.engine import Engine
from specserve.metrics import LOCAL, EngineMetrics, fleet_exposition, merge_expositions
from specserve.model.tokenizer import chat_prompt_ids
from specserve.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

_RECENT_TTFT = 64  # first-token latencies kept for health()


class EngineStepError(RuntimeError):
    """The engine step that was computing this request raised; the request was aborted."""


@dataclass
class _Reply:
    """Where the thread settles a command's result: a future of one event loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def send(self, result: Any = None, error: BaseException | None = None) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass
class _Stream:
    """A request's outputs on their way to its `generate` iterator."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    started: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when its latest output with tokens was delivered


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: _Stream
    reply: _Reply


@dataclass
class _Abort:
    request_id: str
    reply: _Reply | None = None


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between steps and reply with its result."""

    fn: Any
    reply: _Reply


@dataclass
class _Stop:
    pass


class AsyncEngine:
    """Serves one `Engine` to asyncio callers (the HTTP routes) through `EngineClient`."""

    def __init__(
        self,
        engine: Engine,
        *,
        model_name: str | None = None,
        replica: str = LOCAL,
        max_queued_requests: int = 256,
        retry_after: float = 1.0,
    ) -> None:
        if max_queued_requests < 0:
            raise ValueError("max_queued_requests: must be >= 0")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.retry_after = retry_after
        self._info = ModelInfo(
            name=model_name or _model_name(engine.config.model),
            max_model_len=engine.max_model_len,
            vocab_size=engine.arch.vocab_size,
            created=int(time.time()),
        )
        self.model_name = self._info.name
        self.metrics = EngineMetrics(self.model_name, replica)
        engine.attach_stats_sink(self.metrics)  # before the thread starts: it is the only stepper after
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the thread
        self._ttfts: collections.deque[float] = collections.deque(maxlen=_RECENT_TTFT)
        self._load: dict[str, Any] = self._snapshot()
        # Posting and the thread's exit agree under this lock, so no command is left unanswered.
        self._cv = threading.Condition()
        self._accepting = True
        self._crashed = False
        self._posted = self._handled = 0
        self._idle = True
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    # ---- EngineClient ------------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return self._info

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(loop, asyncio.Queue())
        admitted = loop.create_future()
        self._post(_Add(request_id, prompt, params, stream, _Reply(loop, admitted)))
        done = False
        try:
            try:
                await admitted
            except Exception:
                done = True  # refused: nothing to abort
                raise
            while not done:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:  # closed or cancelled early (a client went away): free its pages
                self._post(_Abort(request_id), quiet=True)

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda reply: _Abort(request_id, reply))

    async def flush_cache(self) -> bool:
        return await self._call(lambda reply: _Call(Engine.flush_cache, reply))

    async def check_kv_accounting(self) -> dict[str, Any]:
        """Invariant 4, checked on the engine thread once no request is left: `ok` and, when not,
        `error` (requests still running, or the page pool's complaint)."""
        return await self._call(lambda reply: _Call(self._kv_report, reply))

    async def health(self) -> dict[str, Any]:
        if not (self._accepting and self._thread.is_alive()):
            raise EngineUnavailable("the engine is not running")
        return dict(self._load)

    async def metrics_text(self) -> str:
        """This engine's metrics, and `specserve_replica_up` for it: in one process the engine is the
        whole fleet (under Ray Serve the metrics hub says which replicas are up)."""
        up = fleet_exposition([(self.model_name, self.metrics.replica)], {})
        return merge_expositions([self.metrics.exposition(), up])

    # ---- lifecycle ---------------------------------------------------------------------------

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort every request (their iterators end with finish_reason "abort"), stop the thread."""
        self._post(_Stop(), quiet=True)
        self._thread.join(timeout)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until every posted command is handled and no request is left; False on timeout
        or when the thread died of an error."""
        with self._cv:
            done = self._cv.wait_for(
                lambda: (self._idle and self._handled == self._posted) or not self._accepting, timeout
            )
            return done and not self._crashed

    # ---- the asyncio side --------------------------------------------------------------------

    def _post(self, command: Any, quiet: bool = False) -> None:
        with self._cv:
            if not self._accepting:
                if quiet:
                    return
                raise EngineUnavailable("the engine is shutting down")
            self._posted += 1
            self._idle = False
            self._commands.put(command)

    async def _call(self, make_command) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._post(make_command(_Reply(loop, future)))
        return await future

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._take_commands(block=not self.engine.has_unfinished())
                stop = any(isinstance(c, _Stop) for c in commands)
                for command in commands:
                    if not isinstance(command, _Stop):
                        self._handle(command, refuse=stop)
                if stop:
                    self._abort_all()
                    self.engine.shutdown()  # TP followers leave their loops (from the thread that stepped)
                elif self.engine.has_unfinished():
                    self._step()
                self._publish(len(commands))
                if stop:
                    return
        except BaseException:
            log.exception("the engine thread died")
            self._crashed = True
            raise
        finally:
            self._close()

    def _take_commands(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: Any, refuse: bool) -> None:
        try:
            if isinstance(command, _Add):
                self._add(command, refuse)
            elif isinstance(command, _Abort):
                found = self.engine.abort(command.request_id)
                if command.reply is not None:
                    command.reply.send(found)
            elif isinstance(command, _Call):
                command.reply.send(command.fn(self.engine))
        except Exception as exc:  # a bug here must not take the loop (and every request) down
            log.exception("handling %s failed", type(command).__name__)
            reply = getattr(command, "reply", None)
            if reply is not None:
                reply.send(error=exc)

    def _add(self, command: _Add, refuse: bool) -> None:
        if refuse:
            command.reply.send(error=EngineUnavailable("the engine is shutting down"))
            return
        waiting = self.engine.load()["num_waiting"]
        if waiting >= self.max_queued_requests:
            overloaded = EngineOverloaded(
                f"{waiting} requests are already waiting (max_queued_requests={self.max_queued_requests})",
                self.retry_after,
            )
            command.reply.send(error=overloaded)
            return
        try:
            prompt = command.prompt
            if isinstance(prompt, ChatPrompt):
                prompt = chat_prompt_ids(self.engine.tokenizer, prompt.messages)
            self.engine.add_request(prompt, command.params, command.request_id)
        except Exception as exc:  # ValueError names the field; anything else must not kill the thread
            if not isinstance(exc, ValueError):
                log.exception("admitting request %s failed", command.request_id)
            command.reply.send(error=exc)
            return
        self._streams[command.request_id] = command.stream
        command.reply.send(True)

    def _step(self) -> None:
        try:
            self._deliver(self.engine.step())
        except Exception as exc:
            log.exception("an engine step failed; failing the requests it was running")
            self.metrics.step_errors.inc()
            self._fail_running(EngineStepError(f"engine step failed: {exc!r}"))

    def _fail_running(self, error: EngineStepError) -> None:
        """Abort the running batch (their pages are freed) and fail every request the engine no
        longer knows (running ones, and any whose pending output the failed step dropped)."""
        for req in list(self.engine.scheduler.running):
            self.engine.abort(req.request_id, error=str(error))
        for request_id in [r for r in self._streams if not self.engine.is_active(r)]:
            stream = self._streams.pop(request_id)
            self._send(stream.loop, [(stream.queue, error)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        now = time.monotonic()
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            )
            if stream is None:  # its caller already went away
                continue
            self._observe_latency(stream, out, now)
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            if not self._send(loop, items):  # that loop is gone: so are its callers
                for _, out in items:
                    self._streams.pop(out.request_id, None)
                    self.engine.abort(out.request_id)

    @staticmethod
    def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> bool:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            return False
        return True

    def _observe_latency(self, stream: _Stream, out: RequestOutput, now: float) -> None:
        """TTFT, inter-token latency and e2e, as the caller sees them: from the request reaching
        this client to the output leaving the engine thread."""
        m, tokens = self.metrics, len(out.delta_token_ids)
        if tokens and stream.last_token is None:
            self._ttfts.append(now - stream.started)
            m.time_to_first_token.observe(now - stream.started)
        elif tokens:
            # An output carries all the tokens a verify accepted: each token's share of the gap,
            # once per token, so the histogram's mean is the time per output token.
            per_token = (now - stream.last_token) / tokens
            for _ in range(tokens):
                m.inter_token_latency.observe(per_token)
        if tokens:
            stream.last_token = now
        if out.finished:
            m.e2e_request_latency.observe(now - stream.started)

    def _kv_report(self, engine: Engine) -> dict[str, Any]:
        while engine.has_unfinished() and not engine.scheduler.has_work():
            self._step()  # deliver outputs still pending (e.g. of a request aborted just now)
        if engine.scheduler.has_work():
            return {"ok": False, "error": "requests are still waiting or running", **engine.load()}
        try:
            engine.check_kv_accounting()
        except AssertionError as err:
            return {"ok": False, "error": str(err), **engine.load()}
        return {"ok": True, **engine.load()}

    def _abort_all(self) -> None:
        """Shutdown: abort every request and run the engine dry so each caller gets its last output."""
        for request_id in list(self._streams):
            self.engine.abort(request_id)
        while self.engine.has_unfinished():
            self._step()

    def _snapshot(self) -> dict[str, Any]:
        load = self.engine.load()
        recent = list(self._ttfts)
        load["ttft_recent_s"] = sum(recent) / len(recent) if recent else None
        load["max_queued_requests"] = self.max_queued_requests
        return load

    def _publish(self, handled: int) -> None:
        self._load = self._snapshot()
        with self._cv:
            self._handled += handled
            self._idle = not self.engine.has_unfinished()
            self._cv.notify_all()

    def _close(self) -> None:
        """The thread is leaving: refuse new commands, answer queued ones, end every open stream."""
        with self._cv:
            self._accepting = False
            self._cv.notify_all()
        unavailable = EngineUnavailable("the engine stopped")
        for command in self._take_commands(block=False):
            reply = getattr(command, "reply", None)
            if reply is not None:
                reply.send(error=unavailable)
        for stream in self._streams.values():
            self._send(stream.loop, [(stream.queue, unavailable)])
        self._streams.clear()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _model_name(model: str) -> str:
    """What /v1/models calls the model: the asset name, or a file/folder's name."""
    return model.rstrip("/").rsplit("/", 1)[-1]
