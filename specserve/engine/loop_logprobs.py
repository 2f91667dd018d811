"""Logprobs in the device loop: every verify row's logprob of the token it emits, the top k and the
caller's ids, computed inside the captured iteration and copied to the host with the run's tokens.

A request asking for logprobs used to keep the whole batch out of the loop (one such request in a
batch of 64 sent all 64 to the synchronous path). Now a run whose requests ask for them records,
per iteration and row, the same columns the synchronous path's `logprob_columns` computes from the
same logits: float32 values kept as their bit patterns in the int64 records, so the records stay one
buffer and one host copy. A run's shape (`LogprobShape`: the top k and the ids' width, rounded up to
a power of two) is part of its captured iteration's key, like its sampling filters.
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
    """What a run's iteration records per verify row: the top `top_k` and `ids` named ids."""

    top_k: int
    ids: int

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


def logprob_shape(reqs: list[Request]) -> LogprobShape | None:
    """The shape a run over `reqs` records (None: no request asks), rounded up so that few shapes
    get captured."""
    asking = [r.params for r in reqs if r.params.return_logprob]
    if not asking:
        return None
    top_k = max(p.top_logprobs_num for p in asking)
    ids = max(len(p.token_ids_logprob or ()) for p in asking)
    return LogprobShape(_round_up(top_k), _round_up(ids))


def _round_up(n: int) -> int:
    return 0 if n == 0 else 1 << (n - 1).bit_length()


class LoopLogprobs:
    """The device side: each request's named ids ([B, LOOP_MAX_LOGPROBS], written when a run
    starts) and the records of one iteration's rows (per request, up to `rows` rows of the widest
    shape, flat: a run's [B, rows * width] reads them as one block)."""

    def __init__(self, batch: int, rows: int, device: torch.device) -> None:
        self.ids = torch.zeros(batch, LOOP_MAX_LOGPROBS, dtype=torch.int64, device=device)
        widest = LogprobShape(LOOP_MAX_LOGPROBS, LOOP_MAX_LOGPROBS).width
        self.records = torch.zeros(batch, rows * widest, dtype=torch.int64, device=device)

    def write_ids(self, reqs: list[Request], batch: int) -> None:
        ids = np.zeros((batch, LOOP_MAX_LOGPROBS), dtype=np.int64)
        for b, req in enumerate(reqs):
            named = req.params.token_ids_logprob or ()
            ids[b, : len(named)] = named
        self.ids[:batch].copy_(to_device(torch.from_numpy(ids), self.ids.device))

    def record(self, logits: torch.Tensor, target: torch.Tensor, shape: LogprobShape) -> torch.Tensor:
        """The iteration's records, [B, rows * shape.width] (`records`' leading block), for verify
        rows `logits` [B * rows, V] and the token each row emits if the chain gets that far,
        `target` [B, rows]."""
        batch, rows = target.shape
        ids = self.ids[:batch, None, : shape.ids].expand(batch, rows, shape.ids).reshape(batch * rows, -1)
        own, top_values, top_ids, chosen = logprob_columns(logits, target.reshape(-1), shape.top_k, ids)
        values = torch.cat([own[:, None], top_values, chosen], dim=1).view(torch.int32).to(torch.int64)
        out = self.records[:batch, : rows * shape.width]
        out.view(batch, rows, shape.width).copy_(torch.cat([values, top_ids], dim=1).view(batch, rows, -1))
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
