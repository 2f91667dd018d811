"""Hostile-input limits of the HTTP API (in one process, over a tiny engine): every cap holds at its
value and refuses one more with a 400 naming the field, an oversized body is a 413 before it is read,
the optional API key guards every route but /health, prompts never reach the logs, and nothing on the
HTTP path can unpickle client bytes. `docs/reliability.md` lists each limit with these tests."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from specserve.api import API_KEY_ENV
from specserve.api.app import make_app
from specserve.api.auth import resolve_api_key
from specserve.api.limits import (
    MAX_N,
    MAX_NATIVE_TOP_LOGPROBS,
    MAX_PROMPTS,
    MAX_REQUESTS,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TOKEN_ID_LIST,
    MAX_TOP_LOGPROBS,
)

from api_utils import SMALL_CONTEXT

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/generate"
CONTEXT = SMALL_CONTEXT
KEY = "sk-test-0123456789"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def served(small_served):
    yield small_served
    assert small_served.client.wait_idle(60), "the engine thread did not go idle"


def _completion(**fields):
    return {"prompt": [5, 6, 7], "max_tokens": 1, **fields}


def _native(**fields):
    return {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, **fields}


def _ids(count: int) -> list[list[int]]:
    return [[5 + i % 7] for i in range(count)]


# (limit, route, a body at the limit, the same one past it, the field the 400 names)
LIMITS = [
    ("n", COMPLETIONS, _completion(n=MAX_N), _completion(n=MAX_N + 1), "n"),
    (
        "prompts per request",
        COMPLETIONS,
        {"prompt": _ids(MAX_PROMPTS), "max_tokens": 1},
        {"prompt": _ids(MAX_PROMPTS + 1), "max_tokens": 1},
        "prompt",
    ),
    (
        "choices per request",
        COMPLETIONS,
        {"prompt": _ids(MAX_REQUESTS // MAX_N), "n": MAX_N, "max_tokens": 1},
        {"prompt": _ids(MAX_REQUESTS // MAX_N + 1), "n": MAX_N, "max_tokens": 1},
        "n",
    ),
    (
        "stop strings",
        COMPLETIONS,
        _completion(stop=["zq"] * MAX_STOP),
        _completion(stop=["zq"] * (MAX_STOP + 1)),
        "stop",
    ),
    (
        "stop string length",
        COMPLETIONS,
        _completion(stop=["z" * MAX_STOP_LEN]),
        _completion(stop=["z" * (MAX_STOP_LEN + 1)]),
        "stop[0]",
    ),
    (
        "stop_token_ids",
        COMPLETIONS,
        _completion(stop_token_ids=[3] * MAX_TOKEN_ID_LIST),
        _completion(stop_token_ids=[3] * (MAX_TOKEN_ID_LIST + 1)),
        "stop_token_ids",
    ),
    (
        "logprobs",
        COMPLETIONS,
        _completion(logprobs=MAX_TOP_LOGPROBS),
        _completion(logprobs=MAX_TOP_LOGPROBS + 1),
        "logprobs",
    ),
    (
        "top_logprobs",
        CHAT,
        {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS},
        {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1},
        "top_logprobs",
    ),
    (
        "top_logprobs_num",
        GENERATE,
        _native(return_logprob=True, top_logprobs_num=MAX_NATIVE_TOP_LOGPROBS),
        _native(return_logprob=True, top_logprobs_num=MAX_NATIVE_TOP_LOGPROBS + 1),
        "top_logprobs_num",
    ),
    (
        "token_ids_logprob",
        GENERATE,
        _native(return_logprob=True, token_ids_logprob=[3] * MAX_TOKEN_ID_LIST),
        _native(return_logprob=True, token_ids_logprob=[3] * (MAX_TOKEN_ID_LIST + 1)),
        "token_ids_logprob",
    ),
    (
        "native prompts per request",
        GENERATE,
        _native(input_ids=_ids(MAX_PROMPTS)),
        _native(input_ids=_ids(MAX_PROMPTS + 1)),
        "input_ids",
    ),
    (
        "prompt length",
        COMPLETIONS,
        {"prompt": [5] * (CONTEXT - 1), "max_tokens": 1},
        {"prompt": [5] * (CONTEXT + 1), "max_tokens": 1},
        "prompt",
    ),
    (
        "max_tokens",
        COMPLETIONS,
        {"prompt": [5, 6], "max_tokens": CONTEXT - 2, "ignore_eos": True},
        {"prompt": [5, 6], "max_tokens": CONTEXT - 1},
        "max_tokens",
    ),
    (
        "max_new_tokens",
        GENERATE,
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": CONTEXT - 2}},
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": CONTEXT - 1}},
        "sampling_params.max_new_tokens",
    ),
    (
        "chat prompt length",
        CHAT,
        {"messages": [{"role": "user", "content": "hi " * 8}], "max_tokens": 1},
        {"messages": [{"role": "user", "content": "hi " * CONTEXT}], "max_tokens": 1},
        "messages",
    ),
]


@pytest.mark.parametrize(
    ("route", "at_limit", "past_it", "param"), [x[1:] for x in LIMITS], ids=[x[0] for x in LIMITS]
)
def test_each_limit_holds_at_its_value_and_refuses_one_more(served, route, at_limit, past_it, param):
    accepted = served.http.post(route, json=at_limit)
    assert accepted.status_code == 200, accepted.text
    refused = served.http.post(route, json=past_it)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def test_a_body_over_the_limit_is_a_413_before_it_is_read(served):
    app = make_app(served.client, max_body_bytes=4096)
    body = {"prompt": "x" * 5000, "max_tokens": 1}
    with TestClient(app) as http:
        sized = http.post(COMPLETIONS, json=body)  # Content-Length: refused from the headers alone
        chunked = http.post(
            COMPLETIONS,
            content=iter([b'{"prompt": "', b"x" * 5000, b'", "max_tokens": 1}']),  # no length: counted
            headers={"content-type": "application/json"},
        )
        small = http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
        small_chunked = http.post(
            COMPLETIONS,
            content=iter([b'{"prompt": "x",', b' "max_tokens": 1}']),
            headers={"content-type": "application/json"},
        )
    for response in (sized, chunked):
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert error["code"] == 413 and error["param"] == "body" and "4096 bytes" in error["message"]
    assert small.status_code == 200 and small_chunked.status_code == 200, (small.text, small_chunked.text)


def test_an_api_key_guards_every_route_but_health(served):
    app = make_app(served.client, api_key=KEY)
    documented = [(path, m.upper()) for path, ops in app.openapi()["paths"].items() for m in ops]
    routes = [*documented, ("/openapi.json", "GET"), ("/docs", "GET"), ("/redoc", "GET")]
    assert {("/v1/completions", "POST"), ("/metrics", "GET"), ("/flush_cache", "POST")} <= set(routes)
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}]
    with TestClient(app) as http:
        for path, method in [*routes, ("/no/such/route", "GET")]:
            for headers in wrong:
                response = http.request(method, path, headers=headers)
                if path == "/health":
                    assert response.status_code == 200, response.text
                    continue
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"] == "Bearer"
                error = response.json()["error"]
                assert error["type"] == "authentication_error" and error["code"] == 401
        for scheme in ("Bearer", "bearer"):
            ok = http.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
            assert ok.status_code == 200, ok.text
        done = http.post(COMPLETIONS, json=_completion(), headers={"Authorization": f"Bearer {KEY}"})
        assert done.status_code == 200, done.text
        # Authentication comes first: a stranger's oversized body is refused unread with a 401.
        assert (
            http.post(COMPLETIONS, content=b"x" * (2**20), headers={"content-length": str(2**20)}).status_code
            == 401
        )


def test_the_api_key_comes_from_the_config_or_the_environment(monkeypatch):
    from pydantic import ValidationError

    from specserve.serve.config import ServeConfig

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    assert resolve_api_key(KEY) == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key(KEY) == KEY
    config = ServeConfig(api_key=KEY)
    assert KEY not in repr(config) and config.api_key.get_secret_value() == KEY
    with pytest.raises(ValidationError, match="api_key"):
        ServeConfig(api_key="has spaces")


def test_prompts_never_reach_the_logs(served, caplog, capfd):
    """Requests that succeed, stream, fail validation and fail in an engine step: the prompt text
    appears in no log record and on neither output stream, at DEBUG."""
    canary = "zebra-canary-7d41 tells a secret"
    caplog.set_level(logging.DEBUG)
    model = served.client.engine.model

    def blows(hidden):
        raise RuntimeError("injected fault")

    assert served.http.post(COMPLETIONS, json={"prompt": canary, "max_tokens": 2}).status_code == 200
    messages = [{"role": "user", "content": canary}]
    with served.http.stream("POST", CHAT, json={"messages": messages, "max_tokens": 2, "stream": True}) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    bad = served.http.post(GENERATE, json={"text": canary, "sampling_params": {"temperature": -1}})
    assert bad.status_code == 400
    model.compute_logits = blows
    try:
        failed = served.http.post(COMPLETIONS, json={"prompt": canary, "max_tokens": 2})
    finally:
        del model.compute_logits
    assert failed.status_code == 503
    assert any(r.levelno >= logging.ERROR for r in caplog.records)  # the failure was logged...
    out, err = capfd.readouterr()
    for where, text in [("log records", caplog.text), ("stdout", out), ("stderr", err)]:
        assert "zebra-canary" not in text, where  # ...without the prompt


_UNPICKLERS = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def test_the_http_path_never_unpickles_client_bytes():
    """No module between the socket and the engine imports a deserialiser that runs code, or calls
    eval/exec/torch.load: requests are JSON parsed by pydantic; Ray pickles only our own objects."""
    root = Path(__file__).resolve().parent.parent / "specserve"
    files = sorted((root / "api").glob("*.py")) + sorted((root / "serve").glob("*.py"))
    files.append(root / "engine" / "async_engine.py")
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in {"eval", "exec"}:
                    names = [func.id]
                elif (
                    isinstance(func, ast.Attribute)
                    and func.attr == "load"
                    and ast.unparse(func) == "torch.load"
                ):
                    names = ["torch.load"]
            bad = [n for n in names if n in _UNPICKLERS | {"eval", "exec", "torch.load"}]
            found += [f"{path.name}:{node.lineno}: {n}" for n in bad]
    assert len(files) > 15 and found == []
