"""Shared nouns: what a caller asks for (`SamplingParams`) and what it gets back (`RequestOutput`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

# A logprob entry as the native API returns it: [logprob, token_id, text or None].
LogprobEntry = list


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool): a temperature of infinity sampled uniformly, with no error."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded; the fields and defaults follow SGLang's native `sampling_params`."""

    # None: up to the context length (what an OpenAI chat request without max_tokens asks for);
    # the engine resolves it at admission, so a `Request` always holds an integer.
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    # -1: no input logprobs; k >= 0: input logprobs for prompt tokens from index k on.
    logprob_start_len: int = -1

    def __post_init__(self) -> None:
        # Accept lists (JSON arrays) and a single stop string; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "token_ids_logprob"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._validate()

    def _validate(self) -> None:
        _check(
            self.max_new_tokens is None or (_is_int(self.max_new_tokens) and self.max_new_tokens >= 0),
            "max_new_tokens",
            "must be null or an integer >= 0",
        )
        _check(
            _is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            "min_new_tokens",
            "must be an integer >= 0",
        )
        _check(
            self.max_new_tokens is None or self.min_new_tokens <= self.max_new_tokens,
            "min_new_tokens",
            "must not exceed max_new_tokens",
        )
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            "must be a finite number >= 0",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        # Bounded like the seed: the sampler packs it into an int64 tensor (any k >= the vocabulary is off).
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k < 2**63),
            "top_k",
            "must be -1 (off) or in [1, 2**63)",
        )
        _check(_is_number(self.min_p) and 0 <= self.min_p < 1, "min_p", "must be in [0, 1)")
        _check(
            isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a string or a list of non-empty strings",
        )
        _check(
            isinstance(self.stop_token_ids, tuple)
            and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of token ids >= 0",
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        _check(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63),
            "seed",
            "must be null or an integer in [0, 2**63)",
        )
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a boolean")
        _check(isinstance(self.return_logprob, bool), "return_logprob", "must be a boolean")
        _check(
            _is_int(self.top_logprobs_num) and self.top_logprobs_num >= 0,
            "top_logprobs_num",
            "must be an integer >= 0",
        )
        _check(
            self.token_ids_logprob is None
            or (
                isinstance(self.token_ids_logprob, tuple)
                and all(_is_int(t) and t >= 0 for t in self.token_ids_logprob)
            ),
            "token_ids_logprob",
            "must be null or a list of token ids >= 0",
        )
        _check(
            _is_int(self.logprob_start_len) and self.logprob_start_len >= -1,
            "logprob_start_len",
            "must be an integer >= -1",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0


@dataclass
class TokenLogprobs:
    """Logprobs at one output position, each entry `[logprob, token_id, text]` as the native API has them.

    `top` is filled when `top_logprobs_num` > 0, `chosen` when `token_ids_logprob` is set.
    """

    token: LogprobEntry
    top: list[LogprobEntry] = field(default_factory=list)
    chosen: list[LogprobEntry] = field(default_factory=list)
    offset: int | None = None  # where the token's text starts in the output text (characters)


@dataclass
class RequestOutput:
    """A request's result so far; `finished` marks the last one. `meta` is the native `meta_info`."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    meta: dict[str, Any] = field(default_factory=dict)
    # What is new since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # With `return_logprob`: one entry per delta token, so streams carry logprobs as tokens arrive.
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one of the same request as one: the later's state, both
        deltas in order. What a stream sends when its reader fell behind: nothing is lost."""
        return replace(
            later,
            delta_text=self.delta_text + later.delta_text,
            delta_token_ids=self.delta_token_ids + later.delta_token_ids,
            delta_logprobs=self.delta_logprobs + later.delta_logprobs,
        )


def joined(items: Iterable[Any]) -> Iterator[Any]:
    """A stream's pending items with each run of consecutive `RequestOutput`s joined into one
    (`RequestOutput.then`); anything else (an error) passes through in its place."""
    run: RequestOutput | None = None
    for item in items:
        if isinstance(item, RequestOutput):
            run = item if run is None else run.then(item)
            continue
        if run is not None:
            yield run
            run = None
        yield item
    if run is not None:
        yield run
