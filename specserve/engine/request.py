"""A request's mutable state inside the engine, from arrival to finish.

`token_ids` holds the prompt followed by every generated token. `num_computed` counts the leading
tokens whose KV sits in the cache; the rest are this request's work. A decode step has exactly one
uncomputed token (the last sampled one); a retracted request has none computed and recomputes all.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specserve.engine.sampler import SamplingRow
from specserve.types import SamplingParams

# Stands in `token_ids` for a token an in-flight step is still sampling (overlap scheduling).
FUTURE_TOKEN = -1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class LogprobRecord:
    """Logprob data for one position: the token's own, and optionally top-k and chosen ids."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None = None
    chosen: list[tuple[int, float]] | None = None


class ListMirror:
    """An int64 array copy of a request's growing int list (its pages, its token ids), caught up with
    what was appended since it was last read: a step's page table then copies arrays instead of
    converting Python ints (with page size 1 a request holds a page per token, so that conversion
    grew with every token), and the n-gram drafter searches the tokens without converting them each
    step. Whoever shortens the list in place truncates the mirror (`KVManager` the pages,
    `Request.drop_pending` the tokens); a new list object, or a last mirrored entry that no longer
    equals the list's, starts it over."""

    __slots__ = ("_array", "_valid", "_source", "_last")

    def __init__(self) -> None:
        self._array = np.zeros(0, dtype=np.int64)
        self._valid = 0  # leading entries known to equal the list's
        self._source: list[int] | None = None
        self._last = 0  # the last of them, a Python int (a cheap check that they still do)

    def first(self, items: list[int], n: int) -> np.ndarray:
        """`items[:n]` as an int64 array (a view: copy it before `items` changes)."""
        valid, size = self._valid, len(items)
        if items is not self._source or valid > size or (valid and items[valid - 1] != self._last):
            self._source, self._valid = items, 0
        elif valid == size:  # nothing appended since
            return self._array[: min(n, size)]
        if self._valid < size:
            if size > len(self._array):
                grown = np.zeros(max(2 * len(self._array), size, 16), dtype=np.int64)
                grown[: self._valid] = self._array[: self._valid]
                self._array = grown
            self._array[self._valid : size] = items[self._valid :]
            self._valid, self._last = size, items[-1]
        return self._array[: min(n, size)]

    def truncate(self, n: int) -> None:
        """The list was cut to its first `n` entries."""
        if n < self._valid:
            self._valid = n
            if n:
                self._last = int(self._array[n - 1])


@dataclass(eq=False)  # identity: a request is found in the scheduler's queues by `in` and `remove`
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    status: Status = Status.WAITING
    num_computed: int = 0
    pages: list[int] = field(default_factory=list)
    page_digests: list[bytes] = field(default_factory=list)  # digests of leading pages offered to the cache
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    finish_reason: dict[str, Any] | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_retractions: int = 0
    input_logprobs: list[LogprobRecord] = field(default_factory=list)
    output_logprobs: list[LogprobRecord] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)  # proposed tokens awaiting this step's verify
    draft_probs: Any = None  # [len(draft), V] tensor the draft was sampled from (None: deterministic)
    draft_tree: Any = None  # a `DraftTree` whose nodes are `draft` (tree drafting), None for a chain
    draft_computed: int = 0  # leading positions whose entries in a model drafter's own KV are valid
    draft_state: Any = None  # a drafter's per-request state (e.g. a head's hidden tails), reset with the KV
    draft_backlog: Any = None  # target features steps without drafting left for a head's next extend
    state_slot: int | None = None  # a hybrid model's recurrent-state slot, held with the pages
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0  # drafts sent to verify
    spec_accepted_tokens: int = 0
    spec_accept_histogram: list[int] = field(default_factory=list)  # [n] = steps that accepted n drafts
    # Overlap scheduling: trailing FUTURE_TOKEN entries of token_ids, and whether the request's last
    # step is in flight with nothing left to schedule (its output count or prefill is complete).
    num_pending: int = 0
    settling: bool = False
    stream: bool = True  # an output every step (else only the last)
    page_mirror: ListMirror = field(default_factory=ListMirror, repr=False, compare=False)
    token_mirror: ListMirror = field(default_factory=ListMirror, repr=False, compare=False)
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.prompt_len = len(self.prompt_ids)  # an attribute: read several times per request and step
        p = self.params
        # The fixed part of every `sampling_row`: (temperature, top_k, top_p, min_p).
        self.sampling_fixed = (float(p.temperature), max(p.top_k, 0), float(p.top_p), float(p.min_p))
        self.greedy = p.temperature <= 0  # the argmax decides: no sampling row, batch or noise
        if self.params.wants_input_logprobs and self.params.logprob_start_len == 0 and self.prompt_ids:
            # The first prompt token has nothing before it to be predicted from.
            self.input_logprobs.append(LogprobRecord(self.prompt_ids[0], None, [], []))

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def decoding(self) -> bool:
        """Only the last sampled token lacks KV: the request is past its prefill."""
        return self.num_uncomputed == 1 and self.num_output > 0

    @property
    def prefill_only(self) -> bool:
        return self.params.max_new_tokens == 0

    @property
    def next_input_logprob_index(self) -> int | None:
        """Prompt index whose input logprob comes next, or None when none is (still) wanted."""
        if not self.params.wants_input_logprobs:
            return None
        start = max(self.params.logprob_start_len, 1)
        index = start + len(self.input_logprobs) - (1 if self.params.logprob_start_len == 0 else 0)
        return index if index < self.prompt_len else None

    def max_prefix_match(self) -> int:
        """How many leading tokens may come from the prefix cache: at least one must be computed for its
        logits, and input logprobs need the logits from the token before the first scored one."""
        limit = len(self.token_ids) - 1
        next_lp = self.next_input_logprob_index
        if next_lp is not None:
            limit = min(limit, next_lp - 1)
        return max(limit, 0)

    def sampling_row(self, counter: int) -> SamplingRow:
        """How output token `counter` of this request is drawn (by the target, or a drafter)."""
        return SamplingRow(*self.sampling_fixed, self.seed, counter)

    def drop_pending(self) -> int:
        """Remove the FUTURE_TOKEN entries; returns how many there were."""
        pending, self.num_pending = self.num_pending, 0
        if pending:
            del self.token_ids[len(self.token_ids) - pending :]
            self.token_mirror.truncate(len(self.token_ids))
        return pending

    def finish(self, reason: dict[str, Any]) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_time = time.monotonic()
