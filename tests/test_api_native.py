"""The native `/generate` route (SGLang's shape) with n-gram speculation on, and /health, /metrics,
/flush_cache, over a real tiny engine."""

from __future__ import annotations

import json

import pytest

from specserve import SamplingParams

from api_utils import reference_llm, serve

PROBES = [1, 2, 10, 100, 1000]


@pytest.fixture(scope="module")
def served(tiny_llama):
    with serve(tiny_llama, speculative={"method": "ngram", "num_steps": 4}) as s:
        yield s


@pytest.fixture(autouse=True)
def _idle(served):
    yield
    assert served.client.wait_idle(60), "the engine thread did not go idle"


@pytest.fixture(scope="module")
def prompt_ids(served):
    return served.client.engine.tokenizer.encode(
        "Speculative decoding drafts tokens and the target checks them:"
    )


def _generate(served, **body):
    response = served.http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _sse(served, body) -> list[dict]:
    with served.http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        frames = [line for line in response.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: ") :]) for f in frames[:-1]]


def test_greedy_matches_llm_generate(served, tiny_llama, prompt_ids):
    params = {"max_new_tokens": 16, "temperature": 0}
    expected = reference_llm(tiny_llama).generate([prompt_ids], SamplingParams(**params))[0]
    got = _generate(served, input_ids=prompt_ids, sampling_params=params)
    assert got["output_ids"] == expected.token_ids and got["text"] == expected.text
    meta = got["meta_info"]
    assert meta["finish_reason"] == expected.meta["finish_reason"]
    assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == 16
    assert meta["spec_verify_ct"] >= 1 and sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert meta["spec_accept_length"] == pytest.approx(16 / meta["spec_verify_ct"])


def test_logprobs_equal_prefill_scoring(served, prompt_ids):
    """Invariant 3 through HTTP: logprobs while decoding speculatively == scoring the sequence."""
    logprob_args = dict(return_logprob=True, top_logprobs_num=5, token_ids_logprob=PROBES)
    out = _generate(
        served,
        input_ids=prompt_ids,
        sampling_params={"max_new_tokens": 32, "temperature": 0, "ignore_eos": True},
        logprob_start_len=0,
        **logprob_args,
    )
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 32 and meta["spec_verify_ct"] < 32  # drafts were accepted
    scored = _generate(
        served,
        input_ids=prompt_ids + out["output_ids"],
        sampling_params={"max_new_tokens": 0},
        logprob_start_len=len(prompt_ids),
        **logprob_args,
    )["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(prompt_ids)
    decoded = meta["output_token_logprobs"]
    assert [e[1] for e in decoded] == out["output_ids"] == [e[1] for e in scored["input_token_logprobs"]]
    pairs = [(decoded, scored["input_token_logprobs"])]
    pairs += list(zip(meta["output_top_logprobs"], scored["input_top_logprobs"], strict=True))
    pairs += list(zip(meta["output_token_ids_logprobs"], scored["input_token_ids_logprobs"], strict=True))
    assert len(pairs) == 1 + 2 * 32
    for ours, reference in pairs:
        assert [e[1] for e in ours] == [e[1] for e in reference]
        assert max(abs(a[0] - b[0]) for a, b in zip(ours, reference, strict=True)) <= 1e-4


def test_batch_text_and_per_prompt_params(served):
    got = _generate(
        served,
        text=["Hello", "The sky is"],
        sampling_params=[{"max_new_tokens": 3, "temperature": 0}, {"max_new_tokens": 5, "temperature": 0}],
        rid=["first", "second"],
    )
    assert isinstance(got, list) and [len(r["output_ids"]) for r in got] == [3, 5]
    assert [r["meta_info"]["id"] for r in got] == ["first", "second"]
    single = _generate(served, text="Hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert single["output_ids"] == got[0]["output_ids"]


def test_stream_is_cumulative_and_carries_logprobs(served, prompt_ids):
    body = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    whole = _generate(served, **body)
    chunks = _sse(served, {**body, "stream": True})
    assert len(chunks) > 1
    for before, after in zip(chunks, chunks[1:], strict=False):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    for chunk in chunks[:-1]:  # logprobs so far ride along while running
        assert [e[1] for e in chunk["meta_info"]["output_token_logprobs"]] == chunk["output_ids"]
        assert all(len(top) == 2 for top in chunk["meta_info"]["output_top_logprobs"])
    last = chunks[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    streamed, plain = last["meta_info"]["output_token_logprobs"], whole["meta_info"]["output_token_logprobs"]
    assert [e[1:] for e in streamed] == [e[1:] for e in plain]
    assert [e[0] for e in streamed] == pytest.approx([e[0] for e in plain], abs=1e-4)  # prefix cache hit
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_batch_stream_tags_each_chunk(served):
    chunks = _sse(
        served,
        {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": True},
    )
    ends = {
        c["index"]: c["meta_info"]["completion_tokens"] for c in chunks if c["meta_info"]["finish_reason"]
    }
    assert ends == {0: 4, 1: 4}


def test_stop_strings_and_stop_token_ids(served, prompt_ids):
    free = _generate(served, input_ids=prompt_ids, sampling_params={"max_new_tokens": 16, "temperature": 0})
    text, ids = free["text"], free["output_ids"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = _generate(
        served, input_ids=prompt_ids, sampling_params={"max_new_tokens": 16, "temperature": 0, "stop": stop}
    )
    assert cut["text"] == text[: text.index(stop)] and cut["meta_info"]["finish_reason"]["matched"] == stop
    by_id = _generate(
        served,
        input_ids=prompt_ids,
        sampling_params={"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [ids[5]]},
    )
    assert by_id["output_ids"] == ids[: ids.index(ids[5]) + 1]


def test_health_metrics_flush_models(served):
    health = served.http.get("/health")
    assert health.status_code == 200
    load = health.json()
    assert load["num_running"] == 0 and load["num_waiting"] == 0 and 0 <= load["kv_cache_usage"] <= 1
    _generate(served, text="Hi", sampling_params={"max_new_tokens": 2})
    metrics = served.http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "specserve_generation_tokens_total" in metrics.text
    assert "specserve_spec_draft_tokens_total" in metrics.text
    assert served.http.post("/flush_cache").json()["success"] is True
    assert served.client.engine.kv.pool.num_free == served.client.engine.kv.pool.capacity
    assert served.http.get("/v1/models").json()["data"][0]["id"] == "tiny"
