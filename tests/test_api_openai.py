"""The OpenAI-compatible routes through the official `openai` client, over a real tiny engine."""

from __future__ import annotations

import json

import openai
import pytest

from specserve import SamplingParams

from api_utils import MODEL_NAME, reference_llm, serve

PROMPTS = ["The capital of France is", "Once upon a time"]


@pytest.fixture(scope="module")
def served(tiny_llama):
    with serve(tiny_llama) as s:
        yield s


@pytest.fixture(autouse=True)
def _idle(served):
    yield
    assert served.client.wait_idle(60), "the engine thread did not go idle"


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=served.http)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of the same model through `LLM.generate` (its own engine)."""
    llm = reference_llm(tiny_llama)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    return {p: out for p, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True)}


def test_models(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]


def test_greedy_completion_equals_llm_generate(oai, reference):
    got = oai.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == [reference[p].text for p in PROMPTS]
    assert {c.finish_reason for c in got.choices} <= {"stop", "length"}
    lengths = [len(reference[p].token_ids) for p in PROMPTS]
    prompt_lengths = [reference[p].meta["prompt_tokens"] for p in PROMPTS]
    assert got.usage.completion_tokens == sum(lengths)
    assert got.usage.prompt_tokens == sum(prompt_lengths)
    assert got.usage.total_tokens == sum(lengths) + sum(prompt_lengths)


def test_prompt_as_token_ids(oai, served, reference):
    ids = served.client.engine.tokenizer.encode(PROMPTS[0])
    got = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0)
    assert got.choices[0].text == reference[PROMPTS[0]].text
    batch = oai.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert (
        len(batch.choices) == 2 and batch.choices[0].text == got.choices[0].text[: len(batch.choices[0].text)]
    )
    assert batch.usage.prompt_tokens_details.cached_tokens > 0  # `got` left these pages in the prefix cache


def test_streaming_completion_with_usage(oai, reference):
    chunks = list(
        oai.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[PROMPTS[1]].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        reference[PROMPTS[1]].token_ids
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completion_logprobs_and_stop(oai, reference):
    full = reference[PROMPTS[0]].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    got = oai.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop, "@@@"], logprobs=3
    )
    choice = got.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    # where each token's text starts in the text: in order, and never past its end (the stop cut it)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(offset <= len(choice.text) for offset in lp.text_offset)
    assert all(
        len(top) <= 3 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
        for i, top in enumerate(lp.top_logprobs)
    )


def test_chat(oai, served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    got = oai.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    content = choice.logprobs.content
    assert len(content) == got.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content).startswith(choice.message.content[:1])
    # The same conversation through the engine's template, as ids, gives the same greedy reply.
    ids = served.client.engine.tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    same = oai.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert same.choices[0].text == choice.message.content
    assert got.usage.prompt_tokens == len(ids)


def test_chat_streaming_with_usage(oai):
    kwargs = dict(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count."}], max_tokens=6, temperature=0
    )
    whole = oai.chat.completions.create(**kwargs)
    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_with_a_seed_fans_out_with_seed_plus_i(oai):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=1.0)
    both = oai.completions.create(**kwargs, n=2, seed=7)
    assert [c.index for c in both.choices] == [0, 1]
    singles = [oai.completions.create(**kwargs, seed=seed).choices[0].text for seed in (7, 8)]
    assert [c.text for c in both.choices] == singles
    assert singles[0] != singles[1]
    assert both.usage.completion_tokens == 16


def test_n_streams_every_choice(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            n=2,
            seed=1,
            stream=True,
        )
    )
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}


def test_openai_client_surfaces_a_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL_NAME, prompt="x", max_tokens=4, temperature=5)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="other-model", prompt="x", max_tokens=4)


def test_raw_sse_ends_with_done(served):
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with served.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in response.iter_lines() if line]
    assert frames[-1] == "data: [DONE]"
    assert all(json.loads(f[len("data: ") :])["object"] == "text_completion" for f in frames[:-1])
