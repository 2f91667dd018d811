"""Streams pass on fewer, larger outputs when their reader falls behind or a message budget applies,
and lose nothing: `RequestOutput.then`, `AsyncEngine` over a real tiny engine, the SSE `merge`."""

from __future__ import annotations

import asyncio

import pytest

from specserve import SamplingParams
from specserve.api.streams import Opened, merge
from specserve.types import RequestOutput, TokenLogprobs, joined

from api_utils import async_engine

TWELVE = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True)


def _out(rid: str, ids: list[int], new: int, finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in ids)
    return RequestOutput(
        request_id=rid,
        text=text,
        token_ids=list(ids),
        finished=finished,
        finish_reason="length" if finished else None,
        meta={"completion_tokens": len(ids)},
        delta_text="".join(f"<{t}>" for t in ids[-new:]),
        delta_token_ids=ids[-new:],
        delta_logprobs=[TokenLogprobs([-0.5, t, None]) for t in ids[-new:]],
    )


def _assert_whole(outputs: list[RequestOutput]) -> None:
    """The deltas of a stream's outputs add up to its last output."""
    last = outputs[-1]
    assert last.finished
    assert "".join(o.delta_text for o in outputs) == last.text
    assert [t for o in outputs for t in o.delta_token_ids] == last.token_ids


def test_then_keeps_the_later_state_and_both_deltas():
    a, b, c = _out("r", [1], 1), _out("r", [1, 2, 3], 2), _out("r", [1, 2, 3, 4], 1, finished=True)
    ab = a.then(b)
    assert (ab.text, ab.token_ids, ab.meta, ab.finished) == (b.text, b.token_ids, b.meta, False)
    assert ab.delta_token_ids == [1, 2, 3] and ab.delta_text == "<1><2><3>"
    assert [lp.token[1] for lp in ab.delta_logprobs] == [1, 2, 3]
    abc = ab.then(c)
    assert abc.finished and abc.finish_reason == "length" and abc.delta_token_ids == [1, 2, 3, 4]
    error = RuntimeError("step failed")
    assert list(joined([a, b, error, c])) == [ab, error, c]  # an error splits the runs, in place
    assert b.delta_token_ids == [2, 3]  # nothing joined is changed


def test_a_reader_that_falls_behind_gets_the_piled_up_outputs_as_one(tiny_llama):
    with async_engine(tiny_llama) as client:

        async def scenario():
            gen = client.generate([5, 6, 7], TWELVE)
            first = await anext(gen)
            # The engine runs the request to its end while nobody reads: its outputs pile up.
            assert await asyncio.to_thread(client.wait_idle, 60)
            return [first] + [out async for out in gen]

        outputs = asyncio.run(scenario())
    assert len(outputs) <= 2 and len(outputs[-1].token_ids) == 12  # one, if the first read was late
    _assert_whole(outputs)


def test_a_message_budget_sends_the_first_output_at_once_and_joins_the_rest(tiny_llama):
    # A budget of one message per 1000 s: after the first output a stream waits for its last (a
    # budget that held the first one back would hang this test). The first output holds whatever
    # the engine had made when the reader woke: one token, or more on a busy machine.
    with async_engine(tiny_llama, client_options={"stream_messages_per_s": 1e-3}) as client:

        async def scenario():
            return [out async for out in client.generate([5, 6, 7], TWELVE)]

        outputs = asyncio.run(scenario())
    assert len(outputs) <= 2 and len(outputs[-1].token_ids) == 12
    _assert_whole(outputs)


def test_a_stream_waiting_for_its_share_is_aborted_when_closed(tiny_llama):
    with async_engine(tiny_llama, client_options={"stream_messages_per_s": 1e-3}) as client:

        async def scenario():
            gen = client.generate([9, 8, 7], LONG)
            first = await anext(gen)
            pending = asyncio.ensure_future(anext(gen))  # waits for its share of the budget
            await asyncio.sleep(0.05)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            await gen.aclose()
            return first

        assert not asyncio.run(scenario()).finished
        assert client.wait_idle(60)
        assert client.metrics.sample("specserve_request_finished_total", finish_reason="abort") == 1
        assert not client.engine.has_unfinished()


def test_merge_joins_what_each_stream_piled_up_and_keeps_order():
    async def stream(outputs, error=None):
        for out in outputs:
            yield out
        if error is not None:
            raise error

    async def scenario(error=None):
        a = [_out("a", [1], 1), _out("a", [1, 2], 1), _out("a", [1, 2, 3], 1, finished=True)]
        b = [_out("b", [7], 1), _out("b", [7, 8], 1, finished=True)]
        opened = [Opened(a[0], stream(a[1:])), Opened(b[0], stream(b[1:], error))]
        got: list[tuple[int, RequestOutput]] = []
        try:
            async for item in merge(opened):
                got.append(item)
        except RuntimeError as exc:
            return got, exc
        return got, None

    got, error = asyncio.run(scenario())
    assert error is None
    assert [i for i, _ in got[:2]] == [0, 1]  # each stream's first output first
    for index in (0, 1):
        _assert_whole([out for i, out in got if i == index])
    assert len(got) <= 4  # the pumps ran ahead of the reader: their rest came joined
    got, error = asyncio.run(scenario(RuntimeError("the engine failed")))
    assert str(error) == "the engine failed"
    assert [out.token_ids for i, out in got if i == 1][-1] == [7, 8]  # what came before the error came
