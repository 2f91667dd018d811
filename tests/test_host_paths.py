"""The engine's cheaper host paths behave as the plain ones: a request nobody streams ends with the
output a streamed one ends with, and a step's page table from the per-request page arrays equals the
page lists, however the KV manager changed them."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.kv_manager import KVManager
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import build_step_input

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15], [3, 3, 3, 3]]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(tiny_llama, device="cpu", dtype="float32", max_total_tokens=4096).engine


def _run(engine, params: SamplingParams, stream: bool, abort_after: int | None = None) -> dict:
    """Outputs per request id, in order, of the prompts added together (a cold prefix cache)."""
    engine.flush_cache()
    ids = [engine.add_request(p, params, stream=stream) for p in PROMPTS]
    outputs: dict[str, list] = {rid: [] for rid in ids}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        steps += 1
        if steps == abort_after:
            engine.abort(ids[0])
    return [outputs[rid] for rid in ids]


def _final(outputs) -> tuple:
    last = outputs[-1]
    meta = {k: v for k, v in last.meta.items() if k not in ("id", "e2e_latency")}
    return last.text, last.token_ids, last.finish_reason, meta


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
        # A stop string checked as tokens come, min_new_tokens, logprobs, sampling.
        SamplingParams(max_new_tokens=24, stop=["e", " t"], min_new_tokens=3, return_logprob=True, seed=7),
    ],
)
def test_a_request_nobody_streams_ends_as_a_streamed_one(engine, params):
    streamed = _run(engine, params, stream=True)
    quiet = _run(engine, params, stream=False)
    for s, q in zip(streamed, quiet, strict=True):
        assert len(q) == 1 and q[0].finished  # its one output, the last
        assert _final(q) == _final(s)
        # Everything is new in it: the deltas are the whole output.
        assert q[0].delta_token_ids == q[0].token_ids and q[0].delta_text == q[0].text
        assert q[0].delta_logprobs == [lp for out in s for lp in out.delta_logprobs]


def test_an_aborted_request_nobody_streams_gets_everything_it_made(engine):
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    streamed = _run(engine, params, stream=True, abort_after=6)
    quiet = _run(engine, params, stream=False, abort_after=6)
    assert quiet[0][-1].finish_reason == "abort" and len(quiet[0]) == 1
    assert _final(quiet[0]) == _final(streamed[0])
    assert quiet[0][0].delta_token_ids == quiet[0][0].token_ids


def test_the_page_table_follows_the_page_lists():
    kv = KVManager(num_pages=64, page_size=2, enable_prefix_cache=True)
    reqs = [Request(f"r{i}", list(range(10 + i, 17 + 2 * i)), SamplingParams(), seed=0) for i in range(3)]

    def check() -> None:
        items = [ScheduledItem(r, 0, len(r.token_ids), True) for r in reqs]
        table = build_step_input(items, 2, torch.device("cpu")).attention.page_table
        for row, req in zip(table.tolist(), reqs, strict=True):
            n = -(-len(req.token_ids) // 2)
            assert row[:n] == req.pages[:n] and not any(row[n:])

    for req in reqs:
        assert kv.reserve(req, len(req.token_ids))
    check()
    for step in range(5):  # decode-like growth, a page every other token
        for req in reqs:
            req.token_ids.append(100 + step)
            assert kv.reserve(req, len(req.token_ids))
        check()
    reqs[1].token_ids.extend([8] * 6)  # drafts: their pages are read...
    assert kv.reserve(reqs[1], len(reqs[1].token_ids))
    check()
    del reqs[1].token_ids[-6:]  # ...then rejected: their pages go back, and the next step takes
    kv.trim(reqs[1], len(reqs[1].token_ids))  # as many again (other pages) before any read
    reqs[1].token_ids.extend([9] * 6)
    assert kv.reserve(reqs[1], len(reqs[1].token_ids))
    check()
    kv.free(reqs[0])  # retracted: a new list, refilled from the prefix cache's pages or the free list
    kv.match_prefix(reqs[0])
    assert kv.reserve(reqs[0], len(reqs[0].token_ids))
    check()
    for req in reqs:
        kv.free(req)
