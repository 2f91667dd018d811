"""Bad input gets a 400 naming the field, never a 500 or a leaked page; the server stays healthy."""

from __future__ import annotations

import pytest

from api_utils import serve

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]


def _chat(**fields):
    return {"messages": USER, "max_tokens": 4, **fields}


def _native(**sampling):
    return {"text": "hi", "sampling_params": {"max_new_tokens": 4, **sampling}}


# (route, body, the field the error must name)
BAD = [
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    (COMPLETIONS, {"temperature": 0}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),  # "at least 1 item", not "should be a valid string"
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt"),
    (COMPLETIONS, {"prompt": [7] * 600}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "n": 1000}, "n"),
    (COMPLETIONS, {"prompt": ["x"] * 64, "n": 16}, "n"),
    (COMPLETIONS, {"prompt": "x", "stop": [f"s{i}" for i in range(40)]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": ["ok", ""]}, "stop[1]"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 50}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": 0}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "top_k": 2**64}, "top_k"),  # once failed the whole engine step
    (COMPLETIONS, {"prompt": "x", "seed": -3}, "seed"),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    (COMPLETIONS, {"prompt": "x", "stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (CHAT, _chat(messages=[{"role": "user"}]), "messages[0].content"),
    (
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]),
        "messages[0].content[0].type",
    ),
    (CHAT, _chat(top_logprobs=2), "top_logprobs"),
    (CHAT, _chat(logprobs=True, top_logprobs=500), "top_logprobs"),
    (CHAT, _chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
    (CHAT, _chat(max_completion_tokens=3), "max_tokens"),
    (CHAT, _chat(logprobs="yes"), "logprobs"),
    (CHAT, _chat(presence_penalty=0.5), "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    (GENERATE, _native(repetition_penalty=1.1), "sampling_params.repetition_penalty"),
    (GENERATE, _native(presence_penalty="0"), "sampling_params.presence_penalty"),
    (GENERATE, {"sampling_params": {"max_new_tokens": 4}}, "text"),
    (GENERATE, {"text": "hi", "input_ids": [1, 2]}, "text"),
    (GENERATE, {"input_ids": [[1, 2], [3, "a"]]}, "input_ids[1][1]"),
    (GENERATE, {"input_ids": [1, 49152]}, "input_ids"),
    (GENERATE, _native(temperature=-1), "sampling_params.temperature"),
    (GENERATE, _native(top_k=2**63), "sampling_params.top_k"),
    (GENERATE, _native(min_new_tokens=9), "sampling_params.min_new_tokens"),
    (GENERATE, _native(ignore_eos="yes"), "sampling_params.ignore_eos"),
    (GENERATE, _native(stop_token_ids=[-1]), "sampling_params.stop_token_ids"),
    (GENERATE, _native(max_new_tokens=10_000), "sampling_params.max_new_tokens"),
    (GENERATE, _native(bogus=1), "sampling_params.bogus"),
    (GENERATE, {**_native(), "top_logprobs_num": 10**6, "return_logprob": True}, "top_logprobs_num"),
    (GENERATE, {**_native(), "token_ids_logprob": [10**9], "return_logprob": True}, "token_ids_logprob"),
    (GENERATE, {**_native(), "logprob_start_len": 50, "return_logprob": True}, "logprob_start_len"),
    (GENERATE, {"text": ["a", "b"], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    (GENERATE, {"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
]


@pytest.fixture(scope="module")
def served(tiny_llama):
    with serve(tiny_llama, max_total_tokens=2048) as s:
        yield s


@pytest.fixture(autouse=True)
def _idle(served):
    yield
    assert served.client.wait_idle(60), "the engine thread did not go idle"


def _assert_400(response, param):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: " if param else ""), error


@pytest.mark.parametrize(("route", "body", "param"), BAD, ids=[f"{r}:{p}" for r, _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(served, route, body, param):
    _assert_400(served.http.post(route, json=body), param)
    assert served.http.get("/health").status_code == 200


def test_penalties_at_their_defaults_are_accepted(served):
    """Clients send a penalty's default whether or not it was set (LangChain's `ChatOpenAI`: presence
    and frequency 0; SGLang's: repetition 1); at that value it is a no-op, not an unknown field."""
    zero = {"presence_penalty": 0, "frequency_penalty": 0.0}
    for route, body in (
        (CHAT, _chat(**zero)),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 4, **zero}),
        (GENERATE, _native(**zero, repetition_penalty=1)),
    ):
        response = served.http.post(route, json=body)
        assert response.status_code == 200, response.text
    error = served.http.post(CHAT, json=_chat(presence_penalty=0.5)).json()["error"]
    assert error["message"] == "presence_penalty: only 0 is supported (penalties are not implemented)"


# Bodies as sent (JSON may escape half a surrogate pair; Python's parser takes NaN and Infinity).
RAW = [
    (COMPLETIONS, '{"prompt": "a\\ud800b", "max_tokens": 4}', "prompt"),  # was a 503 asking for a retry
    (COMPLETIONS, '{"prompt": ["ok", "\\udfff"], "max_tokens": 4}', "prompt[1]"),
    (COMPLETIONS, '{"prompt": "x", "top_p": NaN}', "top_p"),
    (COMPLETIONS, '{"prompt": "x", "stop": "\\ud800"}', "stop[0]"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (
        CHAT,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        "messages[0].content[0].text",
    ),
    (GENERATE, '{"text": "\\ud800"}', "text"),
    (GENERATE, '{"text": "hi", "rid": "\\ud800"}', "rid"),  # was a 500 once generated
    (GENERATE, '{"text": "hi", "rid": ""}', "rid"),
    (GENERATE, '{"text": "hi", "rid": "%s"}' % ("r" * 257), "rid"),
    (GENERATE, '{"text": "hi", "sampling_params": {"temperature": Infinity}}', "sampling_params.temperature"),
    (GENERATE, '{"text": "hi", "sampling_params": {"top_p": NaN}}', "sampling_params.top_p"),
]


@pytest.mark.parametrize(("route", "body", "param"), RAW, ids=[f"{r}:{p}" for r, _, p in RAW])
def test_text_that_is_no_unicode_and_numbers_that_are_no_json_are_a_400(served, route, body, param):
    response = served.http.post(route, content=body.encode(), headers={"content-type": "application/json"})
    _assert_400(response, param)
    assert served.http.get("/health").status_code == 200


def test_a_prompt_longer_than_the_context_could_hold_is_refused_untokenised(served, monkeypatch):
    """Tokenised on the engine thread, a 15 MiB prompt held every other request up for 12 s before
    its 400; now prompts are tokenised on a thread of their own, and one of more characters than the
    context could hold as tokens never is."""
    encoder = served.client._encoder
    monkeypatch.setattr(encoder, "_encode", lambda prompt: pytest.fail("tokenised"))
    _assert_400(served.http.post(COMPLETIONS, json={"prompt": "x" * (encoder.max_chars + 1)}), "prompt")
    _assert_400(
        served.http.post(
            CHAT, json={"messages": [{"role": "user", "content": "x" * (encoder.max_chars + 1)}]}
        ),
        "messages",
    )


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_malformed_bodies(served, content):
    response = served.http.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
    _assert_400(response, None)
    assert served.http.get("/health").status_code == 200


def test_an_empty_prompt_list_is_called_empty(served):
    message = served.http.post(COMPLETIONS, json={"prompt": []}).json()["error"]["message"]
    assert message.startswith("prompt: List should have at least 1 item"), message


def test_unknown_route_and_method_keep_the_error_shape(served):
    missing = served.http.get("/v1/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = served.http.get(COMPLETIONS)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == 405


def test_a_refused_batch_starts_nothing(served):
    """One bad prompt in a batch: 400, and the good ones, if admitted, were aborted (pages freed)."""
    before = served.finished("abort")
    _assert_400(
        served.http.post(COMPLETIONS, json={"prompt": [[5, 6], [1, 10**9]], "max_tokens": 4}), "prompt"
    )
    assert served.client.wait_idle(60)
    assert served.finished("abort") - before in (0, 1)
    assert served.client.engine.load()["num_running"] == 0


def test_every_schema_field_is_described(served):
    from pydantic import BaseModel

    from specserve.api import native_schemas, openai_schemas

    models = [
        m
        for module in (openai_schemas, native_schemas)
        for m in vars(module).values()
        if isinstance(m, type) and issubclass(m, BaseModel) and m is not BaseModel
    ]
    assert len(models) > 20
    undescribed = [
        f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description
    ]
    assert undescribed == []
    schema = served.http.get("/openapi.json")
    assert schema.status_code == 200 and "/generate" in schema.json()["paths"]


def test_a_client_gone_away_is_a_quiet_499_and_a_fault_a_logged_500(caplog):
    """Under Ray Serve a disconnect reaches the ingress as Ray's TaskCancelledError (`make_app`'s
    `disconnects`), which was logged as a failed request with a 50-line traceback."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from specserve.api.errors import install_error_handlers

    class Gone(Exception):
        pass

    app = FastAPI()
    install_error_handlers(app, disconnects=(Gone,))

    @app.get("/gone")
    async def gone():
        raise Gone("cancelled")

    @app.get("/broken")
    async def broken():
        raise RuntimeError("a bug")

    http = TestClient(app, raise_server_exceptions=False)
    with caplog.at_level("INFO", logger="specserve.api.errors"):
        assert http.get("/gone").status_code == 499
        assert not [r for r in caplog.records if r.levelname == "ERROR"]
        assert http.get("/broken").status_code == 500
        assert [r for r in caplog.records if r.levelname == "ERROR"]
