"""`AsyncEngine`: the `EngineClient` of one in-process `Engine`, its step loop in a background thread.

The engine is not thread-safe, so only the loop thread touches it. The asyncio side posts commands
(add, abort, flush, stop) to a thread-safe queue, which the thread drains between steps; each step's
outputs go back to the requests' streams through `loop.call_soon_threadsafe` (one call per
event loop per step). Tokenisation and chat templating happen on a thread of their own
(`specserve/engine/prompt_encoder.py`): neither the event loop nor the engine thread runs them, so a
long prompt holds up no other request. A step that raises fails the requests it may have touched and the loop goes on
(or, with `fail_on_step_error`, the whole engine fails: what a Ray Serve replica wants, so that it is
replaced).

Outputs that pile up while a caller is busy reach it as one (`RequestOutput.then`: the later state,
the deltas joined; nothing is lost). With `stream_messages_per_s`, every open stream also waits for
its share of that rate between two outputs (its first output, its last and errors never wait): each
output a caller passes on costs a fixed amount downstream (under Ray Serve, a Ray message from the
replica and one into the ingress, each far dearer than a decode step's host work), so at high
concurrency an output carries several tokens, and at low concurrency one per step as before. `fail(reason)` ends every open request at once from the callers' side, without waiting on
the engine thread, which may be stuck in a collective with a dead TP rank.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from specserve.api.client import (
    EngineOverloaded,
    EngineStepError,
    EngineUnavailable,
    ModelInfo,
    Prompt,
)
from specserve.engine.engine import Engine
from specserve.engine.prompt_encoder import PromptEncoder
from specserve.metrics import LOCAL, EngineMetrics, fleet_exposition, merge_expositions
from specserve.types import RequestOutput, SamplingParams, joined

log = logging.getLogger(__name__)

_RECENT_TTFT = 64  # first-token latencies kept for health()


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


@dataclass(eq=False)  # compared by identity: an abort names the stream it is for
class _Stream:
    """A request's outputs (or an error) on their way to its `generate` iterator; `put` and `take`
    run on its loop."""

    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future  # settled by the thread when it admits or refuses the request
    started: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when its latest output with tokens was delivered
    failed: bool = False  # `AsyncEngine.fail` ended it (set on its loop)
    backlog: collections.deque = field(default_factory=collections.deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # set by what `take` waits for

    def put(self, item: RequestOutput | BaseException) -> None:
        self.backlog.append(item)
        if len(self.backlog) == 1 or _closes(item):
            self.ready.set()

    async def take(self, not_before: float) -> list[RequestOutput | BaseException]:
        """Everything that arrived since the last take, once something has and the loop's clock
        reached `not_before` (at once when the stream's last output or an error is there)."""
        while not (self.backlog and (_closes(self.backlog[-1]) or self.loop.time() >= not_before)):
            self.ready.clear()
            if not self.backlog:
                await self.ready.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.ready.wait(), not_before - self.loop.time())
        items = list(self.backlog)
        self.backlog.clear()
        return items


def _closes(item: RequestOutput | BaseException) -> bool:
    return isinstance(item, BaseException) or item.finished


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
    # A closed `generate` aborts only its own request: the id may belong to another caller (a client
    # reusing an id it does not own was refused, and must not abort the owner's request on leaving).
    stream: _Stream | None = None


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
        fail_on_step_error: bool = False,
        keepalive_s: float | None = None,
        stream_messages_per_s: float | None = None,
    ) -> None:
        """`fail_on_step_error`: a failed step fails the engine for good (`fail`), not only the requests
        it ran. `keepalive_s`: while idle, ping the TP followers this often (`Engine.keepalive`), so
        their wait for the next step never reaches the group's collective timeout.
        `stream_messages_per_s`: the outputs per second all open `generate` streams pass on
        together, at most (each gets an equal share; None: every step's, as they come)."""
        if max_queued_requests < 0:
            raise ValueError("max_queued_requests: must be >= 0")
        if keepalive_s is not None and keepalive_s <= 0:
            raise ValueError("keepalive_s: must be > 0")
        if stream_messages_per_s is not None and not stream_messages_per_s > 0:
            raise ValueError("stream_messages_per_s: must be > 0")
        self.stream_messages_per_s = stream_messages_per_s
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.retry_after = retry_after
        self.fail_on_step_error = fail_on_step_error
        self.keepalive_s = keepalive_s
        self._info = ModelInfo(
            name=model_name or _model_name(engine.config.model),
            max_model_len=engine.max_model_len,
            vocab_size=engine.arch.vocab_size,
            created=int(time.time()),
        )
        self.model_name = self._info.name
        self._encoder = PromptEncoder(engine.tokenizer, engine.max_model_len)
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
        self._failure: str | None = None  # why `fail` was called; under _cv
        self._open: set[_Stream] = set()  # streams of open `generate` calls, any loop; under _cv
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
        prompt = await self._prompt_ids(prompt)
        stream = _Stream(loop, loop.create_future())
        self._open_stream(stream)
        done = False  # the engine thread told this caller the request is over: nothing to abort
        try:
            self._post(_Add(request_id, prompt, params, stream, _Reply(loop, stream.admitted)))
            try:
                await stream.admitted
            except Exception:
                done = not stream.failed  # refused by the thread; after `fail`, it may admit it yet
                raise
            not_before = -math.inf  # the first output goes at once (time to first token)
            while not done:
                for item in joined(await stream.take(not_before)):
                    if isinstance(item, BaseException):
                        done = not stream.failed
                        raise item
                    done = item.finished
                    yield item
                not_before = loop.time() + self._stream_interval()
        finally:
            with self._cv:
                self._open.discard(stream)
            if not done:  # closed or cancelled early (a client went away), or failed: free its pages
                self._post(_Abort(request_id, stream=stream), quiet=True)

    async def _prompt_ids(self, prompt: Prompt) -> Prompt:
        """Text and chat prompts as token ids, off the engine thread (`PromptEncoder`)."""
        self._check_serving()
        try:
            return await self._encoder.ids(prompt)
        except RuntimeError:
            self._check_serving()  # its thread stopped with the engine: a 503, as for any request now
            raise

    def _check_serving(self) -> None:
        with self._cv:
            failure, accepting = self._failure, self._accepting
        if failure is not None:
            raise EngineUnavailable(f"the engine failed: {failure}")
        if not accepting:
            raise EngineUnavailable("the engine is shutting down")

    def _stream_interval(self) -> float:
        """Seconds a stream leaves between two outputs: its share of `stream_messages_per_s`."""
        if self.stream_messages_per_s is None:
            return 0.0
        return len(self._open) / self.stream_messages_per_s

    async def abort(self, request_id: str) -> bool:
        return await self._call(lambda reply: _Abort(request_id, reply))

    async def flush_cache(self) -> bool:
        return await self._call(lambda reply: _Call(Engine.flush_cache, reply))

    async def check_kv_accounting(self) -> dict[str, Any]:
        """Invariant 4, checked on the engine thread once no request is left: `ok` and, when not,
        `error` (requests still running, or the page pool's complaint)."""
        return await self._call(lambda reply: _Call(self._kv_report, reply))

    async def health(self) -> dict[str, Any]:
        if self._failure is not None:
            raise EngineUnavailable(f"the engine failed: {self._failure}")
        if not (self._accepting and self._thread.is_alive()):
            raise EngineUnavailable("the engine is not running")
        return dict(self._load)

    async def metrics_text(self) -> str:
        """This engine's metrics, and `specserve_replica_up` for it: in one process the engine is the
        whole fleet (under Ray Serve the metrics hub says which replicas are up)."""
        up = fleet_exposition([(self.model_name, self.metrics.replica)], {})
        return merge_expositions([self.metrics.exposition(), up])

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the engine failed (`fail`), or None while it serves."""
        return self._failure

    def fail(self, reason: str) -> None:
        """Fail the engine for good, from any thread: every open request ends now with a 503
        (`EngineUnavailable(reason)`), new ones are refused and `health` raises. Nothing here waits on
        the engine thread, which may be stuck in a collective with a dead TP rank; if it is alive, it
        aborts the requests as their streams close, so their pages are freed."""
        if self._set_failure(reason):
            self._end_open_streams()

    def _set_failure(self, reason: str) -> bool:
        """Record the failure (health and admission see it from now on); False if one was already."""
        with self._cv:
            if self._failure is not None:
                return False
            self._failure = reason
        log.error("the engine failed: %s", reason)
        return True

    def _end_open_streams(self) -> None:
        with self._cv:
            reason, streams = self._failure, list(self._open)
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # that caller's loop is closed: nobody is waiting
                stream.loop.call_soon_threadsafe(_fail_stream, stream, reason)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Abort every request (their iterators end with finish_reason "abort"), stop the thread."""
        self._post(_Stop(), quiet=True)
        self._thread.join(timeout)
        self._encoder.close()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until every posted command is handled and no request is left; False on timeout
        or when the thread died of an error."""
        with self._cv:
            done = self._cv.wait_for(
                lambda: (self._idle and self._handled == self._posted) or not self._accepting, timeout
            )
            return done and not self._crashed

    # ---- the asyncio side --------------------------------------------------------------------

    def _open_stream(self, stream: _Stream) -> None:
        with self._cv:  # reentrant: the check and the add hold it together
            self._check_serving()
            self._open.add(stream)

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
                if not commands and not self.engine.has_unfinished():
                    self._keepalive()  # idle for keepalive_s
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
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=self.keepalive_s))
            except queue.Empty:
                return commands
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
                found = self._abort(command)
                if command.reply is not None:
                    command.reply.send(found)
            elif isinstance(command, _Call):
                command.reply.send(command.fn(self.engine))
        except Exception as exc:  # a bug here must not take the loop (and every request) down
            log.exception("handling %s failed", type(command).__name__)
            reply = getattr(command, "reply", None)
            if reply is not None:
                reply.send(error=exc)

    def _abort(self, command: _Abort) -> bool:
        if command.stream is not None and self._streams.get(command.request_id) is not command.stream:
            return False  # that id is not (or no longer) this caller's request
        return self.engine.abort(command.request_id)

    def _add(self, command: _Add, refuse: bool) -> None:
        if refuse or self._failure is not None:
            why = "is shutting down" if refuse else f"failed: {self._failure}"
            command.reply.send(error=EngineUnavailable(f"the engine {why}"))
            return
        # Queued = waiting beyond the running slots still free: requests that arrive together (one
        # batch of commands, before any step) may fill those slots and the queue, not the queue alone.
        load = self.engine.load()
        free = max(0, self.engine.config.scheduler.max_running_requests - load["num_running"])
        queued = max(0, load["num_waiting"] - free)
        if queued >= self.max_queued_requests:
            overloaded = EngineOverloaded(
                f"{queued} requests are already queued (max_queued_requests={self.max_queued_requests})",
                self.retry_after,
            )
            command.reply.send(error=overloaded)
            return
        try:
            self.engine.add_request(command.prompt, command.params, command.request_id)
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
            # Failed first, so that a caller told of the failure below already finds the engine failed.
            failing = self.fail_on_step_error and self._set_failure(f"an engine step failed: {exc!r}")
            self._fail_running(EngineStepError(f"engine step failed: {exc!r}"))  # its requests
            if failing:
                self._end_open_streams()  # and every other open one

    def _keepalive(self) -> None:
        try:
            self.engine.keepalive()
        except Exception as exc:  # a TP rank is gone: this engine cannot step any more
            self.fail(f"the TP group is broken: {exc!r}")

    def _fail_running(self, error: EngineStepError) -> None:
        """Abort the running batch (their pages are freed) and fail every request the engine no
        longer knows (running ones, and any whose pending output the failed step dropped)."""
        for req in list(self.engine.scheduler.running):
            self.engine.abort(req.request_id, error=str(error))
        for request_id in [r for r in self._streams if not self.engine.is_active(r)]:
            stream = self._streams.pop(request_id)
            self._send(stream.loop, [(stream, error)])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        now = time.monotonic()
        for out in outputs:
            stream = (
                self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            )
            if stream is None:  # its caller already went away
                continue
            self._observe_latency(stream, out, now)
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            if not self._send(loop, items):  # that loop is gone: so are its callers
                for _, out in items:
                    self._streams.pop(out.request_id, None)
                    self.engine.abort(out.request_id)

    @staticmethod
    def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, Any]]) -> bool:
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
            self._send(stream.loop, [(stream, unavailable)])
        self._streams.clear()


def _fail_stream(stream: _Stream, reason: str) -> None:
    """On the stream's loop: end its `generate` with a 503, whether it awaits admission or outputs."""
    stream.failed = True
    error = EngineUnavailable(f"the engine failed: {reason}")
    if not stream.admitted.done():
        stream.admitted.set_exception(error)
        stream.admitted.exception()  # retrieved: a caller that left meanwhile never awaits it
    stream.put(error)


def _put_all(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)


def _model_name(model: str) -> str:
    """What /v1/models calls the model: the asset name, or a file/folder's name."""
    return model.rstrip("/").rsplit("/", 1)[-1]
