"""Overlap scheduling: steps launched before the step before them is collected give exactly the
outputs of the synchronous engine (tokens, text, finish reasons, logprobs), for greedy and sampled
requests, stop tokens and strings, aborts, retractions in a tiny KV pool and CUDA-graph buckets."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.request import FUTURE_TOKEN

VOCAB = 96


@pytest.fixture(scope="module")
def target(small_vocab_target):
    return small_vocab_target


def _llm(target, overlap: bool, **kwargs) -> LLM:
    llm = LLM(target, device="cpu", dtype="float32", overlap_schedule=overlap, **kwargs)
    assert llm.engine._overlap is overlap
    return llm


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def _same(ours, reference) -> None:
    for o, r in zip(ours, reference, strict=True):
        assert (o.token_ids, o.text, o.finish_reason) == (r.token_ids, r.text, r.finish_reason)
        assert FUTURE_TOKEN not in o.token_ids


def test_greedy_sampled_and_stopping_requests_match_the_synchronous_engine(target):
    prompts = _prompts(6)
    reference_llm = _llm(target, False)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    probe = reference_llm.generate(prompts, greedy)
    stop_ids = [o.token_ids[len(o.token_ids) // 2] for o in probe[:3]]  # tokens each output does reach
    params = [
        greedy,
        SamplingParams(max_new_tokens=30, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=stop_ids, min_new_tokens=3),
        SamplingParams(max_new_tokens=1, temperature=0.0),
        SamplingParams(
            max_new_tokens=16, temperature=0.7, top_k=5, seed=11, stop=[probe[4].text[8:12] or "x"]
        ),
        SamplingParams(max_new_tokens=0),
    ]
    reference = reference_llm.generate(prompts, params)
    outs = _llm(target, True).generate(prompts, params)
    _same(outs, reference)
    assert {o.finish_reason for o in outs} >= {"length", "stop"}


def test_logprob_requests_stay_overlapped_and_match(target):
    """Logprob requests (prompt and output, top k, named ids, beside one asking none) are scored at
    launch and read when their step settles: their steps stay in flight like any other (they used
    to be settled at once, the host waiting on the device every step), with the synchronous
    engine's outputs and logprobs."""
    prompts = _prompts(4, seed=1)
    asking = SamplingParams(
        max_new_tokens=12,
        temperature=0.8,
        seed=3,
        return_logprob=True,
        top_logprobs_num=3,
        token_ids_logprob=(4, 9),
        logprob_start_len=0,
    )
    params = [asking, asking, SamplingParams(max_new_tokens=10, temperature=0.0), asking]
    reference = _llm(target, False).generate(prompts, params)
    llm = _llm(target, True)
    in_flight = []
    step = llm.engine.step

    def counting():
        out = step()
        in_flight.append(llm.engine._inflight is not None)
        return out

    llm.engine.step = counting
    outs = llm.generate(prompts, params)
    _same(outs, reference)
    for o, r in zip(outs, reference, strict=True):
        for name in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs"):
            assert o.meta.get(name) == r.meta.get(name)
        assert o.meta.get("output_token_ids_logprobs") == r.meta.get("output_token_ids_logprobs")
    assert outs[0].meta["output_token_ids_logprobs"] and "output_top_logprobs" not in outs[2].meta
    assert sum(in_flight) >= 10, "logprob steps left in flight while the next is launched"


def test_retraction_in_a_tiny_pool_and_chunked_prefill(target):
    prompts = _prompts(8, seed=2)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    kwargs = {"max_total_tokens": 200, "max_batched_tokens": 32, "page_size": 4}
    reference = _llm(target, False, **kwargs).generate(prompts, params)
    llm = _llm(target, True, **kwargs)
    _same(llm.generate(prompts, params), reference)
    assert llm.engine.scheduler.num_retracted > 0


def test_abort_while_a_step_is_in_flight(target):
    llm = _llm(target, True)
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=50, temperature=0.0)) for p in _prompts(3, 3)]
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    engine.abort(ids[1])
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert FUTURE_TOKEN not in out.token_ids
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].finish_reason == "abort"
    assert [len(finished[i].token_ids) for i in (ids[0], ids[2])] == [50, 50]


def test_graph_buckets_with_overlap(target):
    prompts = _prompts(5, seed=4)
    params = [SamplingParams(max_new_tokens=5 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    kwargs = {"attention_backend": "triton", "cuda_graphs": True, "cuda_graph_max_batch": 4}
    reference = _llm(target, False, **kwargs).generate(prompts, params)
    _same(_llm(target, True, **kwargs).generate(prompts, params), reference)


def test_a_failed_launch_hands_out_the_step_before_then_raises(target):
    llm = _llm(target, True)
    engine = llm.engine
    request_id = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, temperature=0.0))
    assert engine.step() == []  # the prefill is in flight
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: (_ for _ in ()).throw(RuntimeError("injected"))
    try:
        outs = engine.step()  # the decode launch fails; the prefill's token still comes out
    finally:
        del engine.model.compute_logits
    assert [len(o.token_ids) for o in outs] == [1] and compute_logits is not None
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def test_settings():
    from specserve.config import EngineConfig, SpeculativeConfig

    assert EngineConfig().use_overlap() and EngineConfig(tp_size=2).use_overlap()
    assert not EngineConfig(speculative=SpeculativeConfig(method="ngram")).use_overlap()
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(overlap_schedule=True, speculative=SpeculativeConfig(method="ngram"))
