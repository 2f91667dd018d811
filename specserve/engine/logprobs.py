"""Logprobs of chosen rows: the target token's, the top-k, and caller-named ids, in one pass.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before
temperature or filtering), so decoding and prefill-only scoring of one sequence agree exactly.
All rows are computed together and copied to the host once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
    logprobs = torch.log_softmax(logits[index], dim=-1)
    own = logprobs.gather(1, targets.view(-1, 1)).squeeze(1)
    k = max(r.top_k for r in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen = _chosen_ids(logprobs, rows)
    # One host copy for the whole step.
    host_targets, host_own, host_chosen = targets.tolist(), own.tolist(), chosen.tolist()
    host_top = (top_values.tolist(), top_ids.tolist()) if k else None
    records: list[LogprobRecord] = []
    offset = 0
    for i, r in enumerate(rows):
        top = list(zip(host_top[1][i][: r.top_k], host_top[0][i][: r.top_k], strict=True)) if host_top else []
        ids = r.token_ids or ()
        values = host_chosen[offset : offset + len(ids)]
        offset += len(ids)
        records.append(LogprobRecord(host_targets[i], host_own[i], top, list(zip(ids, values, strict=True))))
    return records


def _chosen_ids(logprobs: torch.Tensor, rows: Sequence[LogprobRow]) -> torch.Tensor:
    """Flat logprobs of every row's named ids (validated against the vocabulary at admission)."""
    row_index = [i for i, r in enumerate(rows) for _ in r.token_ids or ()]
    col_index = [t for r in rows for t in r.token_ids or ()]
    index = to_device(torch.tensor([row_index, col_index], dtype=torch.long), logprobs.device)
    return logprobs[index[0], index[1]]


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
