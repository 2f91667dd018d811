"""Engine behaviour on SmolLM2 (fp32, CPU): batching, chunked prefill, retract, prefix cache, stops, errors.

Every test here is followed by the KV accounting check of conftest.py.
"""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.model.loader import load_model

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(smollm2_gguf):
    import torch

    return load_model(str(smollm2_gguf), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, device="cpu", dtype="float32", max_total_tokens=4096)


@pytest.fixture(scope="module")
def prompts(llm, mtbench_questions):
    """16 chat prompts of mixed lengths (some questions cut short, some long)."""
    out = []
    for i, q in enumerate(mtbench_questions[:16]):
        text = q if i % 3 else q[: 20 + 7 * i]
        out.append(llm._chat_ids([{"role": "user", "content": text}]))
    return out


def _make(loaded, **kwargs) -> LLM:
    return LLM(loaded, device="cpu", dtype="float32", **kwargs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_invariance(loaded, prompts, page_size):
    llm = _make(loaded, page_size=page_size, max_total_tokens=4096, max_batched_tokens=96)
    batched = llm.generate(prompts, GREEDY)
    # Alone, the shortest, the longest and a spread between them (all 16 alone cost CI a minute).
    by_len = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for i in sorted({by_len[0], by_len[-1], *by_len[3::4]}):
        assert llm.generate([prompts[i]], GREEDY)[0].token_ids == batched[i].token_ids


def test_retract_when_kv_runs_short(loaded, prompts):
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    reference = _make(loaded, max_total_tokens=4096).generate(prompts[:8], params)
    # Each request fits alone (< 128 tokens) but eight at once do not.
    tight = _make(loaded, page_size=4, max_total_tokens=256, enable_prefix_cache=False)
    outs = tight.generate(prompts[:8], params)
    assert tight.engine.scheduler.num_retracted > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]


def test_prefix_cache_reuses_pages_and_keeps_outputs(loaded, prompts):
    cached = _make(loaded, page_size=4, max_total_tokens=4096)
    uncached = _make(loaded, page_size=4, max_total_tokens=4096, enable_prefix_cache=False)
    first = cached.generate([prompts[0]], GREEDY)[0]
    again = cached.generate([prompts[0], prompts[1]], GREEDY)
    assert again[0].meta["cached_tokens"] >= len(prompts[0]) - 4
    assert first.meta["cached_tokens"] == 0
    expected = uncached.generate([prompts[0], prompts[1]], GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]
    assert first.token_ids == expected[0].token_ids


def test_flush_cache_frees_every_page(loaded, prompts):
    llm = _make(loaded, page_size=1, max_total_tokens=2048)
    llm.generate(prompts[:2], GREEDY)
    assert llm.engine.kv.pool.num_evictable > 0
    assert llm.engine.flush_cache()
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.capacity


def test_abort_frees_pages(llm, prompts):
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=50, temperature=0.0)) for p in prompts[:3]]
    for _ in range(3):
        engine.step()
    assert engine.abort(ids[1])
    assert not engine.abort("no-such-request")
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[ids[1]].finish_reason == "abort"
    assert finished[ids[0]].finish_reason in ("stop", "length")


def test_stop_conditions(llm, prompts):
    free_run = llm.generate([prompts[0]], GREEDY)[0]
    stop_token = free_run.token_ids[5]
    by_token = llm.generate(
        [prompts[0]], SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[stop_token])
    )[0]
    assert by_token.token_ids == free_run.token_ids[: free_run.token_ids.index(stop_token) + 1]
    assert by_token.meta["finish_reason"] == {"type": "stop", "matched": stop_token}
    stop_text = free_run.text[10:14]
    by_text = llm.generate(
        [prompts[0]], SamplingParams(max_new_tokens=16, temperature=0.0, stop=[stop_text])
    )[0]
    assert by_text.text == free_run.text[: free_run.text.index(stop_text)]
    assert by_text.meta["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 16


def test_eos_min_new_tokens_and_ignore_eos(llm):
    prompt = llm._chat_ids([{"role": "user", "content": "Say just the word yes."}])
    natural = llm.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0.0))[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in llm.engine.loaded.eos_token_ids
    n = len(natural.token_ids)
    longer = llm.generate([prompt], SamplingParams(max_new_tokens=40, temperature=0.0, min_new_tokens=n + 3))[
        0
    ]
    assert len(longer.token_ids) >= n + 3
    assert not set(longer.token_ids[: n + 3]) & set(llm.engine.loaded.eos_token_ids)
    ignored = llm.generate([prompt], SamplingParams(max_new_tokens=n + 5, temperature=0.0, ignore_eos=True))[
        0
    ]
    assert len(ignored.token_ids) == n + 5 and ignored.finish_reason == "length"


def test_seeded_sampling_reproducible_whatever_the_batch(llm, prompts):
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = llm.generate([prompts[2]], params)[0]
    in_batch = llm.generate(
        [prompts[0], prompts[2], prompts[5]],
        [SamplingParams(max_new_tokens=7, temperature=1.0), params, GREEDY],
    )[1]
    assert alone.token_ids == in_batch.token_ids
    other_seed = llm.generate([prompts[2]], SamplingParams(max_new_tokens=12, temperature=0.9, seed=99))[0]
    assert other_seed.token_ids != alone.token_ids


def test_prefill_only_scoring(llm, prompts):
    out = llm.generate(
        [prompts[0]], SamplingParams(max_new_tokens=0, return_logprob=True, logprob_start_len=0)
    )[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    lps = out.meta["input_token_logprobs"]
    assert len(lps) == len(prompts[0]) and lps[0][0] is None
    assert [e[1] for e in lps] == prompts[0]
    assert all(e[0] <= 0 for e in lps[1:])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_logprobs_equal_prefill_scoring(loaded, prompts, temperature):
    llm = _make(loaded, page_size=4, max_total_tokens=4096, max_batched_tokens=32)
    ids = [7, 42, 1000]
    params = SamplingParams(
        max_new_tokens=12,
        temperature=temperature,
        seed=5,
        ignore_eos=True,
        return_logprob=True,
        top_logprobs_num=5,
        token_ids_logprob=ids,
        logprob_start_len=len(prompts[3]) - 3,
    )
    out = llm.generate([prompts[3]], params)[0]
    decoded = out.meta["output_token_logprobs"]
    assert [e[1] for e in decoded] == out.token_ids
    assert len(out.meta["input_token_logprobs"]) == 3
    scored = llm.generate(
        [prompts[3] + out.token_ids],
        SamplingParams(
            max_new_tokens=0,
            return_logprob=True,
            top_logprobs_num=5,
            token_ids_logprob=ids,
            logprob_start_len=len(prompts[3]),
        ),
    )[0].meta
    _assert_close(decoded, scored["input_token_logprobs"])
    for a, b in zip(out.meta["output_top_logprobs"], scored["input_top_logprobs"], strict=True):
        _assert_close(a, b)
    for a, b in zip(out.meta["output_token_ids_logprobs"], scored["input_token_ids_logprobs"], strict=True):
        _assert_close(a, b)
        assert [e[1] for e in a] == ids


def _assert_close(a: list, b: list) -> None:
    assert [e[1] for e in a] == [e[1] for e in b]
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b, strict=True)) <= 1e-4


def test_logprob_entries_carry_text(llm, prompts):
    out = llm.generate(
        [prompts[0]],
        SamplingParams(max_new_tokens=3, temperature=0.0, return_logprob=True, top_logprobs_num=2),
    )[0]
    entry = out.meta["output_token_logprobs"][0]
    assert entry[2] == llm.tokenizer.decode([entry[1]])
    assert len(out.meta["output_top_logprobs"][0]) == 2


def test_chat_and_token_id_prompts(llm):
    by_chat = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    ids = llm._chat_ids([{"role": "user", "content": "hi"}])
    assert llm.generate(ids, GREEDY)[0].token_ids == by_chat.token_ids
    assert llm.generate("hi there", GREEDY)[0].meta["prompt_tokens"] == len(llm.tokenizer.encode("hi there"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": -3}, "seed"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),  # sampled uniformly, with no error
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_requests_name_the_field(llm):
    vocab = llm.engine.arch.vocab_size
    cases = [
        ([vocab], SamplingParams(), "input_ids"),
        ([], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(stop_token_ids=[vocab + 5]), "stop_token_ids"),
        ([1, 2], SamplingParams(token_ids_logprob=[vocab]), "token_ids_logprob"),
        ([1, 2], SamplingParams(max_new_tokens=10**6), "max_new_tokens"),
        ([1, 2], SamplingParams(return_logprob=True, logprob_start_len=9), "logprob_start_len"),
    ]
    for prompt, params, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate([prompt], params)
    with pytest.raises(ValueError, match="speculative.method"):
        LLM(llm.engine.loaded, speculative={"method": "medusa"})
    with pytest.raises(ValueError, match="speculative.num_steps"):
        LLM(llm.engine.loaded, speculative={"method": "ngram", "num_steps": 0})
    with pytest.raises(ValueError, match="speculative"):
        LLM(llm.engine.loaded, speculative={"method": "ngram", "steps": 3})
    with pytest.raises(ValueError, match="page_size"):
        LLM(llm.engine.loaded, device="cpu", dtype="float32", page_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(llm.engine.loaded, dtype="float64")
    with pytest.raises(ValueError, match="prompts"):  # bytes were read as token ids
        llm.generate(b"hello", GREEDY)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("hello", 5)
    with pytest.raises(ValueError, match="messages"):  # named `prompts`
        llm.chat([])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device": 5}, "device"),  # an AttributeError
        ({"device": "cudafoo"}, "device"),  # a RuntimeError from torch
        ({"device": "cuda:99"}, "device"),  # no such GPU here (or none at all)
        ({"max_running_requests": "4"}, "max_running_requests"),  # a TypeError
        ({"max_running_requests": 2.5}, "max_running_requests"),
        ({"chunked_prefill": "no"}, "chunked_prefill"),  # truthy: it turned chunked prefill on
        ({"seed": -1}, "seed"),
        ({"max_model_len": 1.5}, "max_model_len"),
        ({"max_model_len": 10**6}, "max_model_len"),  # cut to the model's without a word
        ({"speculative": {"method": "ngram", "ngram_min_match": "1"}}, "ngram_min_match"),
        ({"speculative": {"method": "ngram", "num_steps": True}}, "num_steps"),
    ],
)
def test_bad_engine_settings_name_the_setting(loaded, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(loaded, **{"dtype": "float32", **kwargs})


def test_a_model_that_is_not_there_or_broken_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="model: cannot resolve model"):
        LLM(str(tmp_path / "nothing"), device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="model: .*lacks 'hidden_size'"):  # a KeyError
        LLM(str(tmp_path), device="cpu")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    with pytest.raises(ValueError, match="model: .*junk.gguf"):
        LLM(str(junk), device="cpu")
    with pytest.raises(ValueError, match="speculative.draft_model: cannot resolve"):
        LLM(
            "smollm2-135m-instruct",
            device="cpu",
            speculative={"method": "standalone", "draft_model": str(tmp_path / "x")},
        )


def test_failed_batch_leaves_no_request_behind(llm, prompts):
    with pytest.raises(ValueError, match="input_ids"):
        llm.generate([prompts[0], [10**9]], GREEDY)
    assert not llm.engine.has_unfinished()
