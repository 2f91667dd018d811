"""AsyncEngine behind the app: client disconnects abort, overload is a 429, a failing step fails only
its requests, shutdown ends streams and answers 503; all over a real tiny engine (CPU, fp32)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from specserve import SamplingParams
from specserve.api.client import ChatPrompt, EngineOverloaded, EngineStepError, EngineUnavailable
from specserve.engine.async_engine import _Call

from api_utils import async_engine, serve

LONG = SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True)  # up to the context


@pytest.fixture(scope="module")
def served(tiny_llama):
    with serve(tiny_llama) as s:
        yield s


@pytest.fixture(autouse=True)
def _idle(served):
    yield
    assert served.client.wait_idle(60), "the engine thread did not go idle"


async def _call_and_leave(app, path: str, body: dict, spec: str, leave_after: int) -> tuple[int | None, int]:
    """Drive the ASGI app as a server would; the client goes away after `leave_after` body chunks
    (ASGI spec 2.0: an http.disconnect message; 2.4: sending fails with OSError)."""
    payload, gone = json.dumps(body).encode(), asyncio.Event()
    state = {"status": None, "chunks": 0, "asked": False}

    async def receive():
        if not state["asked"]:
            state["asked"] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if leave_after > 0 or spec == "2.4":
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            state["status"] = message["status"]
        elif message.get("body"):
            if state["chunks"] >= leave_after and spec == "2.4":
                raise OSError("the client went away")
            state["chunks"] += 1
            if state["chunks"] >= leave_after:
                gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"testserver")],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    try:
        await app(scope, receive, send)
    except Exception as exc:  # 2.4: starlette re-raises the failed send as ClientDisconnect
        assert type(exc).__name__ == "ClientDisconnect"
    return state["status"], state["chunks"]


@pytest.mark.parametrize(
    ("path", "stream", "spec"),
    [
        ("/v1/completions", True, "2.0"),
        ("/v1/chat/completions", True, "2.4"),
        ("/generate", True, "2.0"),
        ("/v1/completions", False, "2.0"),
    ],
)
def test_client_disconnect_aborts_the_request(served, path, stream, spec):
    if path == "/generate":
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
    elif path == "/v1/completions":
        body = {"prompt": [5, 6, 7], "max_tokens": None, "ignore_eos": True}
    else:
        body = {"messages": [{"role": "user", "content": "Talk."}], "ignore_eos": True}
    before, ran_out = served.finished("abort"), served.finished("length")
    status, chunks = asyncio.run(
        _call_and_leave(served.app, path, {**body, "stream": stream}, spec, leave_after=2 if stream else 0)
    )
    assert status == (200 if stream else 499) and chunks >= (2 if stream else 1)
    assert served.client.wait_idle(60)
    assert served.finished("abort") == before + 1
    assert served.finished("length") == ran_out  # it did not run to the end of the context
    served.client.engine.check_kv_accounting()  # the thread is idle: safe to look from here


def test_cancelling_generate_aborts(served):
    async def scenario():
        gen = served.client.generate([9, 8, 7], LONG)
        first = await anext(gen)
        task = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return first

    before = served.finished("abort")
    assert not asyncio.run(scenario()).finished
    assert served.client.wait_idle(60) and served.finished("abort") == before + 1


def test_bad_input_raises_before_any_output(served):
    async def first_of(prompt, params, request_id=None):
        return await anext(served.client.generate(prompt, params, request_id))

    with pytest.raises(ValueError, match="^top_logprobs_num: "):
        asyncio.run(first_of("hi", SamplingParams(return_logprob=True, top_logprobs_num=10**6)))
    with pytest.raises(ValueError, match=r"^messages\[0\]: "):
        asyncio.run(first_of(ChatPrompt(({"role": "user"},)), SamplingParams()))
    out = asyncio.run(
        first_of(ChatPrompt(({"role": "user", "content": "hi"},)), SamplingParams(max_new_tokens=1))
    )
    template = served.client.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True
    )
    template = template["input_ids"] if hasattr(template, "keys") else template
    assert out.finished and out.meta["prompt_tokens"] == len(template)

    async def duplicate_id():
        gen = served.client.generate([1, 2, 3], LONG, request_id="dup")
        await anext(gen)
        try:
            with pytest.raises(ValueError, match="^request_id: "):
                await first_of([1, 2], SamplingParams(), request_id="dup")
        finally:
            await gen.aclose()

    asyncio.run(duplicate_id())


def test_overload_is_a_429_with_retry_after(tiny_llama):
    with serve(tiny_llama, max_running_requests=1, max_queued_requests=1) as s:

        async def scenario():
            running = s.client.generate([5, 6, 7], LONG)
            await anext(running)  # scheduled: it holds the only running slot
            waiting = asyncio.ensure_future(anext(s.client.generate([8, 9], LONG)))
            while (await s.client.health())["num_waiting"] < 1:
                await asyncio.sleep(0.005)
            transport = httpx.ASGITransport(s.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
                refused = await http.post("/generate", json={"text": "hi"})
                health = await http.get("/health")
            waiting.cancel()
            await running.aclose()
            return refused, health

        refused, health = asyncio.run(scenario())
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert health.status_code == 200 and health.json()["num_running"] == 1
        assert s.client.wait_idle(60) and s.finished("length") == 0


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(served):
    model = served.client.engine.model
    compute_logits, fuse = model.compute_logits, {"calls": 1}

    def blows_on_its_nth_call(hidden):  # a fault injected into the real model
        fuse["calls"] -= 1
        if fuse["calls"] == 0:
            raise RuntimeError("injected fault")
        return compute_logits(hidden)

    async def scenario():
        with pytest.raises(EngineStepError, match="injected fault"):
            async for _ in served.client.generate([4, 5, 6], SamplingParams(max_new_tokens=4)):
                pass
        return [out async for out in served.client.generate([4, 5, 6], SamplingParams(max_new_tokens=4))]

    model.compute_logits = blows_on_its_nth_call
    try:
        outs = asyncio.run(scenario())
        fuse["calls"] = 2  # the prefill streams a chunk, then the first decode step fails
        body = {"prompt": [4, 5, 6], "max_tokens": 4, "stream": True}
        with served.http.stream("POST", "/v1/completions", json=body) as response:
            frames = [
                json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"
            ]
    finally:
        del model.compute_logits
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    assert response.status_code == 200 and frames[0]["choices"][0]["text"] is not None
    assert frames[-1]["error"]["code"] == 503 and "injected fault" in frames[-1]["error"]["message"]
    assert served.client.metrics.sample("specserve_engine_step_errors_total") == 2
    assert served.http.get("/health").status_code == 200


def test_shutdown_ends_streams_and_answers_503(tiny_llama):
    with serve(tiny_llama) as s:

        async def scenario():
            gen = s.client.generate([5, 6, 7], LONG)
            await anext(gen)
            await asyncio.to_thread(s.client.shutdown)
            outs = [out async for out in gen]
            with pytest.raises(EngineUnavailable):
                await anext(s.client.generate("hi", SamplingParams()))
            return outs

        outs = asyncio.run(scenario())
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        health = s.http.get("/health")
        assert health.status_code == 503 and "Retry-After" in health.headers
        refused = s.http.post("/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"


def test_a_reused_request_id_never_aborts_its_owner(served):
    """A caller that reuses a running request's id is refused; leaving before the refusal arrives must
    not abort the owner's request (its abort names its own stream, not just the id)."""

    async def scenario():
        owner = served.client.generate([1, 2, 3], SamplingParams(max_new_tokens=48, ignore_eos=True), "mine")
        outs = [await anext(owner)]
        intruder = asyncio.ensure_future(anext(served.client.generate([4, 5], SamplingParams(), "mine")))
        await asyncio.sleep(0)  # posted, awaiting admission
        intruder.cancel()
        await asyncio.gather(intruder, return_exceptions=True)
        outs += [out async for out in owner]
        return outs

    outs = asyncio.run(scenario())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 48


def test_fail_ends_every_open_request_with_a_503_at_once(tiny_llama):
    """`fail` (a dead TP follower, under Ray) ends running and still-unadmitted requests from the callers'
    side with EngineUnavailable, refuses new ones, turns /health into a 503; the thread frees the pages."""
    with serve(tiny_llama, max_running_requests=1) as s:

        async def scenario():
            running = s.client.generate([5, 6, 7], LONG)
            await anext(running)
            waiting = asyncio.ensure_future(anext(s.client.generate([8, 9], LONG)))
            while (await s.client.health())["num_waiting"] < 1:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(s.client.fail, "TP follower rank 1 failed: ActorDiedError")
            with pytest.raises(EngineUnavailable, match="rank 1 failed"):
                async for _ in running:
                    pass
            with pytest.raises(EngineUnavailable, match="rank 1 failed"):
                await waiting
            with pytest.raises(EngineUnavailable, match="rank 1 failed"):
                await anext(s.client.generate("hi", SamplingParams()))

        asyncio.run(asyncio.wait_for(scenario(), 60))
        health = s.http.get("/health")
        assert health.status_code == 503 and "rank 1 failed" in health.json()["error"]["message"]
        refused = s.http.post("/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert s.client.wait_idle(60) and s.client.engine.load()["num_running"] == 0
        s.client.engine.check_kv_accounting()


def test_fail_on_step_error_fails_the_engine(tiny_llama):
    """What a Ray replica runs with: one failed step fails the engine (503s, unhealthy) so Serve
    replaces it, rather than going on with possibly broken state."""
    with async_engine(tiny_llama, client_options={"fail_on_step_error": True}) as client:
        model = client.engine.model

        def blows(hidden):
            raise RuntimeError("device fault")

        async def scenario():
            with pytest.raises(EngineStepError, match="device fault"):
                async for _ in client.generate([4, 5, 6], SamplingParams(max_new_tokens=4)):
                    pass
            with pytest.raises(EngineUnavailable, match="device fault"):
                await client.health()

        model.compute_logits = blows
        try:
            asyncio.run(asyncio.wait_for(scenario(), 60))
        finally:
            del model.compute_logits
        assert client.failure is not None and "device fault" in client.failure


def test_an_idle_engine_pings_its_followers_and_fails_when_they_are_gone(tiny_llama):
    """Idle TP followers wait for the next step in a collective bounded by the group's timeout: the
    engine thread pings them every `keepalive_s`; a failed ping means the group is broken."""
    with async_engine(tiny_llama, client_options={"keepalive_s": 0.05}) as client:
        engine = client.engine
        pings = threading.Event()
        engine.keepalive = pings.set
        assert pings.wait(30), "the idle engine never pinged"

        def broken():
            raise RuntimeError("Connection closed by peer")

        engine.keepalive = broken
        deadline = time.monotonic() + 30
        while client.failure is None:
            assert time.monotonic() < deadline, "a failed ping did not fail the engine"
            time.sleep(0.01)
        assert "Connection closed by peer" in client.failure
        del engine.keepalive


def test_requests_arriving_together_fill_the_free_slots_before_the_queue(tiny_llama):
    """Admission counts as queued only the waiting requests beyond the free running slots: requests
    the engine thread sees in one batch (before any step) are not refused for filling those slots."""
    with async_engine(tiny_llama, max_running_requests=1, max_queued_requests=1) as client:

        async def scenario():
            gate = threading.Event()
            held = asyncio.ensure_future(client._call(lambda reply: _Call(lambda _: gate.wait(30), reply)))
            await asyncio.sleep(0.05)  # the thread is held: the adds below reach it in one batch
            short = SamplingParams(max_new_tokens=4, ignore_eos=True)  # the waiting one starts soon
            gens = [client.generate([5 + i, 6], short) for i in range(3)]
            firsts = [asyncio.ensure_future(anext(g)) for g in gens]
            await asyncio.sleep(0.05)
            gate.set()
            await held
            results = await asyncio.gather(*firsts, return_exceptions=True)
            for gen in gens:
                await gen.aclose()
            return results

        results = asyncio.run(asyncio.wait_for(scenario(), 60))
        refused = [r for r in results if isinstance(r, EngineOverloaded)]
        assert len(refused) == 1 and all(not isinstance(r, BaseException) for r in results[:2]), results
        assert client.wait_idle(60)
