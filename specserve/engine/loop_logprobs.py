"""Logprobs in the device loop: every verify row's logprob of the token it emits, the top k and the
caller's ids, computed inside the captured iteration and copied to the host with the run's tokens.

A request asking for logprobs used to keep the whole batch out of the loop (one such request in a
batch of 64 sent all 64 to the synchronous path). Now a run whose requests ask for them records,
per iteration and row, the same columns the synchronous path's `logprob_columns` computes from the
same logits: float32 values kept as their bit patterns in the int64 records, so the records stay one
buffer and one host copy. Only the asking requests' rows are scored: each has a slot (the run's
`slots`, request rows in order), and slot s's records ride in row s of the run's records. A run's
shape (`LogprobShape`: the slots, the top k and the ids' width, each rounded up to a power of two)
is part of its captured iteration's key, like its sampling filters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.host_copy import to_device
from specserve.engine.logprobs import logprob_columns
from specserve.engine.request import LogprobRecord, Request
from specserve.types import SamplingParams

# The most top logprobs and named ids a request may ask for and still run in the loop (OpenAI's
# top_logprobs stops at 20); more run on the synchronous path.
LOOP_MAX_LOGPROBS = 32


@dataclass(frozen=True)
class LogprobShape:
    """What a run's iteration records: for `slots` requests, per verify row, the token's own
    logprob, the top `top_k` and `ids` named ids."""

    top_k: int
    ids: int
    slots: int = 1

    @property
    def width(self) -> int:
        """Columns per row: the token's own, the top values, the named ids' values, the top ids."""
        return 1 + 2 * self.top_k + self.ids


def loop_takes_logprobs(params: SamplingParams) -> bool:
    """Whether the loop can record what the request asks for (none asked: trivially)."""
    if not params.return_logprob:
        return True
    named = len(params.token_ids_logprob or ())
    return params.top_logprobs_num <= LOOP_MAX_LOGPROBS and named <= LOOP_MAX_LOGPROBS


def logprob_shape(reqs: list[Request], batch: int) -> LogprobShape | None:
    """The shape a run over `reqs` in a bucket of `batch` rows records (None: no request asks),
    rounded up so that few shapes get captured."""
    asking = [r.params for r in reqs if r.params.return_logprob]
    if not asking:
        return None
    top_k = max(p.top_logprobs_num for p in asking)
    ids = max(len(p.token_ids_logprob or ()) for p in asking)
    return LogprobShape(_round_up(top_k), _round_up(ids), min(_round_up(len(asking)), batch))


def asking_rows(reqs: list[Request]) -> tuple[int, ...]:
    """The rows of the requests that ask for logprobs: slot s records row `asking_rows[s]`."""
    return tuple(b for b, req in enumerate(reqs) if req.params.return_logprob)


def _round_up(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()


class LoopLogprobs:
    """The device side, per slot: the request row it records and that request's named ids
    ([B, LOOP_MAX_LOGPROBS]; both written when a run starts), and the records of one iteration
    (up to `rows` verify rows of the widest shape, flat: a run's [slots, rows * width] reads them
    as one block)."""

    def __init__(self, batch: int, rows: int, device: torch.device) -> None:
        self.rows = torch.zeros(batch, dtype=torch.int64, device=device)
        self.ids = torch.zeros(batch, LOOP_MAX_LOGPROBS, dtype=torch.int64, device=device)
        self.steps = torch.arange(rows, dtype=torch.int64, device=device)
        widest = LogprobShape(LOOP_MAX_LOGPROBS, LOOP_MAX_LOGPROBS).width
        self.records = torch.zeros(batch, rows * widest, dtype=torch.int64, device=device)

    def write(self, reqs: list[Request], asking: tuple[int, ...], slots: int) -> None:
        """The `slots` slots of a run over `reqs` (`asking`: its `asking_rows`; pad slots record row
        0, unread), one copy."""
        packed = np.zeros((slots, 1 + LOOP_MAX_LOGPROBS), dtype=np.int64)
        for slot, row in enumerate(asking[:slots]):
            named = reqs[row].params.token_ids_logprob or ()
            packed[slot, 0] = row
            packed[slot, 1 : 1 + len(named)] = named
        packed = to_device(torch.from_numpy(packed), self.ids.device)
        self.rows[:slots].copy_(packed[:, 0])
        self.ids[:slots].copy_(packed[:, 1:])

    def record(self, logits: torch.Tensor, target: torch.Tensor, shape: LogprobShape) -> torch.Tensor:
        """The iteration's records, [slots, rows * shape.width] (`records`' leading block), for
        verify rows `logits` [B * rows, V] and the token each row emits if the chain gets that far,
        `target` [B, rows]: the slots' requests' rows only."""
        rows, slots = target.shape[1], shape.slots
        index = (self.rows[:slots, None] * rows + self.steps[:rows]).view(-1)
        ids = self.ids[:slots, None, : shape.ids].expand(slots, rows, shape.ids).reshape(slots * rows, -1)
        own, top_values, top_ids, chosen = logprob_columns(
            logits.index_select(0, index), target.view(-1).index_select(0, index), shape.top_k, ids
        )
        values = torch.cat([own[:, None], top_values, chosen], dim=1).view(torch.int32).to(torch.int64)
        out = self.records[:slots, : rows * shape.width]
        out.view(slots, rows, shape.width).copy_(torch.cat([values, top_ids], dim=1).view(slots, rows, -1))
        return out


def loop_records(
    raw: np.ndarray, tokens: list[int], params: SamplingParams, shape: LogprobShape
) -> list[LogprobRecord]:
    """One request's records of one iteration from its rows' host records `raw` [rows, width]: the
    first len(tokens) rows, each the synchronous path's `LogprobRecord` for the token it emitted."""
    k, named = shape.top_k, params.token_ids_logprob or ()
    values = raw[: len(tokens), : 1 + k + shape.ids].astype(np.int32).view(np.float32).tolist()
    top_ids = raw[: len(tokens), 1 + k + shape.ids :].tolist()
    top = params.top_logprobs_num
    return [
        LogprobRecord(
            token,
            row[0],
            list(zip(ids[:top], row[1 : 1 + top], strict=True)),
            list(zip(named, row[1 + k :], strict=False)),
        )
        for token, row, ids in zip(tokens, values, top_ids, strict=True)
    ]
