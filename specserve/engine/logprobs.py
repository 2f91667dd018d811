"""Logprobs of chosen rows: the target token's, the top-k, and caller-named ids, in one pass.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature or filtering), so decoding and prefill-only scoring of one sequence agree exactly.
All rows are computed together and copied to the host once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.engine.host_copy import to_device
from specserve.engine.request import LogprobRecord
from specserve.engine.scheduler import ScheduledItem
from specserve.engine.step_input import StepInput


@dataclass(frozen=True)
class LogprobRow:
    row: int  # row of the logits tensor
    top_k: int
    token_ids: tuple[int, ...] | None


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[LogprobRow], targets: torch.Tensor
) -> list[LogprobRecord]:
    """`targets[i]` is the token whose logprob row `rows[i]` reports."""
    if not rows:
        return []
    index = to_device(torch.tensor([r.row for r in rows]), logits.device)
    ids = np.zeros((len(rows), max(len(r.token_ids or ()) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r.token_ids or ())] = r.token_ids or ()
    top_k = max(r.top_k for r in rows)
    columns = logprob_columns(logits[index], targets, top_k, to_device(torch.from_numpy(ids), logits.device))
    # One host copy for the whole step.
    host_targets, (own, top_values, top_ids, chosen) = targets.tolist(), (c.tolist() for c in columns)
    return [
        LogprobRecord(
            host_targets[i],
            own[i],
            list(zip(top_ids[i][: r.top_k], top_values[i][: r.top_k], strict=True)),
            list(zip(r.token_ids or (), chosen[i], strict=False)),
        )
        for i, r in enumerate(rows)
    ]


def logprob_columns(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of fp32 `logits` [R, V]: the logprob of `targets` [R], the top `top_k` logprobs and
    their ids [R, top_k], and the logprobs of `ids` [R, C]. The device loop's records take the same
    arithmetic, so its logprobs are the synchronous path's to the bit. No [R, V] log-softmax is
    stored: each column is its logit less the row's log-sum-exp."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    own = logits.gather(1, targets.view(-1, 1)) - lse
    top_values, top_ids = logits.topk(top_k, dim=-1)
    return own[:, 0], top_values - lse, top_ids, logits.gather(1, ids) - lse


@dataclass
class StepLogprobs:
    """One request's logprob records from one step: scored prompt tokens, and the sampled token's."""

    inputs: list[LogprobRecord] = field(default_factory=list)
    outputs: list[LogprobRecord] = field(default_factory=list)  # one per emitted token, in order


def step_logprobs(
    items: list[ScheduledItem],
    inp: StepInput,
    logits: torch.Tensor,
    emitted: dict[int, list[int]],
    drawn_at: dict[int, list[int]] | None = None,
) -> dict[int, StepLogprobs]:
    """Records per scheduled item index, for every row this step's requests asked logprobs of.
    Emitted token i was drawn at the item's sample row i, or, after a tree verify, at sample row
    `drawn_at[index][i]` (the accepted path's rows)."""
    rows: list[LogprobRow] = []
    targets: list[torch.Tensor] = []
    owners: list[tuple[int, bool]] = []  # (item index, is the sampled token)
    for spec in inp.input_logprobs:
        params = items[spec.item].request.params
        ids = items[spec.item].request.token_ids[spec.first_token : spec.first_token + len(spec.logit_rows)]
        rows.extend(LogprobRow(r, params.top_logprobs_num, params.token_ids_logprob) for r in spec.logit_rows)
        targets.append(torch.tensor(ids, dtype=torch.long))
        owners.extend((spec.item, False) for _ in spec.logit_rows)
    for index, sample_rows in zip(inp.sample_items, inp.sample_rows, strict=True):
        params = items[index].request.params
        if params.return_logprob:
            tokens = emitted[index]
            at = (drawn_at or {}).get(index)
            drawn = [sample_rows[r] for r in at] if at is not None else sample_rows[: len(tokens)]
            rows.extend(LogprobRow(r, params.top_logprobs_num, params.token_ids_logprob) for r in drawn)
            targets.append(torch.tensor(tokens, dtype=torch.long))
            owners.extend((index, True) for _ in tokens)
    if not rows:
        return {}
    target = torch.cat([t.to(logits.device) for t in targets])
    result: dict[int, StepLogprobs] = {}
    for (index, is_output), record in zip(owners, compute_logprobs(logits, rows, target), strict=True):
        entry = result.setdefault(index, StepLogprobs())
        (entry.outputs if is_output else entry.inputs).append(record)
    return result
