"""Property-based fuzzing of `/generate` and `/v1/*` against the in-process app over a tiny engine: no
body, valid or hostile, gets a 5xx; a 400 names the field; a request that runs returns a well-formed
result; and no input fails another client's request running meanwhile. Then schemathesis drives the
OpenAPI document the app serves (schema-valid and schema-violating bodies, with its response checks).

Deterministic (`derandomize`, no example database) and bounded (`max_examples`), so CI is stable; the
app's context is 64 tokens and `max_tokens` small, so a request that runs costs milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from specserve import SamplingParams

from api_utils import MODEL_NAME, SMALL_CONTEXT

CONTEXT = SMALL_CONTEXT
VOCAB = 49152  # the tiny model's vocabulary (SmolLM2's tokenizer)
FUZZ = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def served(small_served):
    yield small_served
    assert small_served.client.wait_idle(60), "the engine thread did not go idle"


# ---- strategies ---------------------------------------------------------------------------------

_EDGES = [0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 10**30, 1e308, -1e308, 5e-324, -0.0, "", "0", [], {}]
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)  # JSON's NaN / Infinity, which Python parses
    | st.text(max_size=12)
    | st.sampled_from(_EDGES)
)
JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
IDS = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
TEXT = st.text(max_size=24)  # any unicode, surrogates and NULs included
STOP = st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=3)


_SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 60) | st.integers(2**40, 2**63 - 1),
    "min_p": st.floats(0, 0.95),
    "seed": st.integers(0, 2**63 - 1),
    "stop": STOP,
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
}


_OPENAI = {
    "model": st.just(MODEL_NAME),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 2),
    "user": st.text(max_size=6),
    **_SAMPLING,
}
# Given in every valid body (the mutations drop it now and then): without it a request runs to the
# end of the context, the one thing that would make examples slow.
_MAX_TOKENS = {"max_tokens": st.integers(1, 8)}
_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": TEXT
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), min_size=1, max_size=3),
    },
    optional={"name": st.text(max_size=6)},
)
_NATIVE = {
    "sampling_params": st.fixed_dictionaries(
        {"max_new_tokens": st.integers(0, 8)},
        optional={**_SAMPLING, "min_new_tokens": st.integers(0, 3)},
    )
}
_NATIVE_OPTIONAL = {
    "return_logprob": st.booleans(),
    "top_logprobs_num": st.integers(0, 5),
    "token_ids_logprob": st.lists(st.integers(0, VOCAB - 1), max_size=3),
    "logprob_start_len": st.integers(-1, 4),
    "stream": st.booleans(),
    "rid": st.text(max_size=6),
}
VALID = {
    "/v1/completions": st.fixed_dictionaries(
        {
            "prompt": TEXT
            | IDS
            | st.lists(TEXT, min_size=1, max_size=3)
            | st.lists(IDS, min_size=1, max_size=3),
            **_MAX_TOKENS,
        },
        optional={**_OPENAI, "logprobs": st.integers(0, 5)},
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(_MESSAGE, min_size=1, max_size=3), **_MAX_TOKENS},
        optional={
            **_OPENAI,
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
        },
    ),
    "/generate": st.one_of(
        st.fixed_dictionaries(
            {"text": TEXT | st.lists(TEXT, min_size=1, max_size=3), **_NATIVE}, optional=_NATIVE_OPTIONAL
        ),
        st.fixed_dictionaries(
            {"input_ids": IDS | st.lists(IDS, min_size=1, max_size=3), **_NATIVE}, optional=_NATIVE_OPTIONAL
        ),
    ),
}


# Numbers at the edges of every integer and float type, for the fields that hold numbers: a value a
# schema lets through but a tensor cannot hold would fail a whole engine step (top_k = 2**64 once did).
EDGE_NUMBERS = [2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 5e-324, -1, 0]
EDGE_NUMBERS += [float("inf"), float("-inf"), float("nan")]
_NUMERIC = ["temperature", "top_p", "top_k", "min_p", "seed"]
NUMERIC_FIELDS = {
    "/v1/completions": [*_NUMERIC, "n", "max_tokens", "min_tokens", "logprobs"],
    "/v1/chat/completions": [
        *_NUMERIC,
        "n",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "top_logprobs",
    ],
    "/generate": ["top_logprobs_num", "logprob_start_len"]
    + [f"sampling_params.{name}" for name in [*_NUMERIC, "max_new_tokens", "min_new_tokens"]],
}
MUTATIONS = ["valid", "valid", "edge number", "edge number", "junk value", "drop", "unknown", "nested"]
MUTATIONS += ["any JSON", "bytes"]


@st.composite
def bodies(draw, route: str) -> bytes:
    """Mostly a valid body, or one with a single field broken (a number at an edge, a junk value, a
    field dropped, an unknown name, nested junk), or junk JSON of any type, or bytes that are not JSON."""
    body: Any = draw(VALID[route])
    how = draw(st.sampled_from(MUTATIONS))
    if how == "bytes":
        return draw(st.binary(max_size=64))
    if how == "any JSON":
        body = draw(JUNK)
    elif how == "edge number":
        *parent, name = draw(st.sampled_from(NUMERIC_FIELDS[route])).split(".")
        (body[parent[0]] if parent else body)[name] = draw(st.sampled_from(EDGE_NUMBERS))
    elif how in ("junk value", "drop") and body:
        key = draw(st.sampled_from(sorted(body)))
        if how == "drop":
            del body[key]
        else:
            body[key] = draw(JUNK)
    elif how == "unknown":
        body[draw(st.text(min_size=1, max_size=10))] = draw(JUNK)
    elif how == "nested":
        body.setdefault("sampling_params", {})
        if isinstance(body["sampling_params"], dict):
            body["sampling_params"][draw(st.sampled_from([*_SAMPLING, "max_new_tokens", "x"]))] = draw(JUNK)
    return json.dumps(body, allow_nan=True).encode()


# ---- checks -------------------------------------------------------------------------------------


def _check_error(response, content: bytes) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
    assert isinstance(error["message"], str) and error["message"]
    if response.status_code != 400:
        return
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):  # an object: the error names the field at fault
        assert error["param"], error
    if error["param"]:
        assert error["message"].startswith(f"{error['param']}: "), error


def _check_result(route: str, response, content: bytes) -> None:
    body = json.loads(content)
    if body.get("stream"):
        frames = [line for line in response.text.split("\n\n") if line]
        assert frames[-1] == "data: [DONE]", frames[-3:]
        for frame in frames[:-1]:
            event = json.loads(frame.removeprefix("data: "))
            assert "error" not in event, event  # no failure in-band either
        return
    result = response.json()
    if route == "/generate":
        results = result if isinstance(result, list) else [result]
        assert all(isinstance(r["text"], str) and r["meta_info"]["finish_reason"] for r in results)
    else:
        assert result["choices"] and result["usage"]["total_tokens"] >= result["usage"]["prompt_tokens"]


# Bodies that once got past validation and failed an engine step: always tried, besides the search.
REGRESSIONS = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "top_k": 2**64},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "top_k": 2**63,
    },
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 10**30}},
}


def _post(served, route: str, content: bytes):
    return served.http.post(route, content=content, headers={"content-type": "application/json"})


class Witness:
    """Another client's requests, run one after another on their own thread while the fuzzer works:
    none may fail, whatever the fuzzer sends (one bad request must never fail a shared engine step)."""

    def __init__(self, client) -> None:
        self.client, self.stop, self.done, self.errors = client, threading.Event(), 0, []
        self.thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        params = SamplingParams(max_new_tokens=CONTEXT // 2, ignore_eos=True, temperature=0.7)
        while not self.stop.is_set():
            try:
                outs = [out async for out in self.client.generate([11, 12, 13], params)]
                assert outs[-1].finish_reason == "length", outs[-1].finish_reason
                self.done += 1
            except Exception as err:  # recorded, and asserted on the test's thread
                self.errors.append(repr(err))
            await asyncio.sleep(0.05)  # a steady trickle, leaving the CPU to the fuzzer

    def __enter__(self) -> Witness:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.mark.parametrize("route", sorted(VALID))
def test_fuzzed_bodies_never_get_a_5xx(served, route):
    statuses: dict[int, int] = {}

    @FUZZ
    @given(content=bodies(route))
    @example(content=json.dumps(REGRESSIONS[route]).encode())
    def run(content: bytes) -> None:
        response = _post(served, route, content)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400, 404), (response.status_code, response.text[:300])
        if response.status_code == 200:
            _check_result(route, response, content)
        else:
            _check_error(response, content)

    with Witness(served.client) as witness:
        run()
    assert witness.errors == [] and witness.done >= 1
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 20, statuses  # both sides explored


# ---- schemathesis over the served OpenAPI document -----------------------------------------------


def test_schemathesis_on_the_openapi_document(served):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode
    from schemathesis.checks import positive_data_acceptance

    schema = schemathesis.openapi.from_asgi("/openapi.json", served.app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /generate", "POST /v1/completions", "GET /health"}
    for op in operations:
        # Schema-valid bodies may still break rules the schema cannot state (a prompt longer than the
        # context, min > max), which are 400s: so "valid data is accepted" is the one check left out.
        _call_with_cases(op, GenerationMode.POSITIVE, excluded=[positive_data_acceptance])
        if len(op.body):  # schema-violating bodies: each must be a 400
            _call_with_cases(op, GenerationMode.NEGATIVE, excluded=[positive_data_acceptance])


def _call_with_cases(op, mode, excluded) -> None:
    negative = mode.value == "negative"

    @settings(FUZZ, max_examples=40)
    @given(case=op.as_strategy(mode))
    def run(case) -> None:
        response = case.call_and_validate(excluded_checks=excluded)
        assert response.status_code < 500, response.text[:300]
        if negative:
            assert response.status_code == 400, (case.body, response.text[:300])

    run()
