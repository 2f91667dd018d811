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
from specserve_kernels.top_logits import row_top_logits


@dataclass(frozen=True)
class LogprobRow:
    row: int  # row of the logits tensor
    top_k: int
    token_ids: tuple[int, ...] | None


def compute_logprobs(
    logits: torch.Tensor, rows: Sequence[LogprobRow], targets: torch.Tensor
) -> list[LogprobRecord]:
    """`targets[i]` is the token whose logprob row `rows[i]` reports."""
    return ScoredRows.launch(logits, rows, targets).records()


class ScoredRows:
    """Logprob rows scored on the device, their columns copying to the host (two copies behind one
    event): `records` waits for them. So a step launched with overlap scheduling scores its rows
    before the next step reuses its logits, and the host reads them only when it settles the step."""

    def __init__(self, rows: Sequence[LogprobRow], ints: torch.Tensor, floats: torch.Tensor) -> None:
        self.rows = list(rows)
        self.ints, self.floats = ints, floats  # [R, 1 + K]: target, top ids; [R, 1 + K + C]
        self.done: torch.cuda.Event | None = None
        if ints.is_cuda:  # a non-blocking copy to the host lands in page-locked memory: truly asynchronous
            self.ints, self.floats = ints.to("cpu", non_blocking=True), floats.to("cpu", non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    @classmethod
    def launch(
        cls, logits: torch.Tensor, rows: Sequence[LogprobRow], targets: torch.Tensor | None
    ) -> ScoredRows:
        """Score `rows` of `logits` for `targets` (on the logits' device: no host wait)."""
        if not rows:
            empty = torch.zeros(0, 1, dtype=torch.long)
            return cls(rows, empty, empty.float())
        index = to_device(torch.tensor([r.row for r in rows]), logits.device)
        ids = np.zeros((len(rows), max(len(r.token_ids or ()) for r in rows)), dtype=np.int64)
        for i, r in enumerate(rows):
            ids[i, : len(r.token_ids or ())] = r.token_ids or ()
        top_k = max(r.top_k for r in rows)
        own, top_values, top_ids, chosen = logprob_columns(
            logits[index], targets, top_k, to_device(torch.from_numpy(ids), logits.device)
        )
        ints = torch.cat([targets.view(-1, 1), top_ids], dim=1)
        return cls(rows, ints, torch.cat([own[:, None], top_values, chosen], dim=1))

    def records(self) -> list[LogprobRecord]:
        if self.done is not None:
            self.done.synchronize()
        ints, floats = self.ints.tolist(), self.floats.tolist()
        out = []
        for r, row_ints, row_floats in zip(self.rows, ints, floats, strict=True):
            k, widest = r.top_k, len(row_ints) - 1  # the row's top k, the step's
            top = list(zip(row_ints[1 : 1 + k], row_floats[1 : 1 + k], strict=True))
            chosen = list(zip(r.token_ids or (), row_floats[1 + widest :], strict=False))
            out.append(LogprobRecord(row_ints[0], row_floats[0], top, chosen))
        return out


def logprob_columns(
    logits: torch.Tensor, targets: torch.Tensor, top_k: int, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of fp32 `logits` [R, V]: the logprob of `targets` [R], the top `top_k` logprobs and
    their ids [R, top_k], and the logprobs of `ids` [R, C]. The device loop's records take the same
    arithmetic, so its logprobs are the synchronous path's to the bit. No [R, V] log-softmax is
    stored: each column is its logit less the row's log-sum-exp (`row_top_logits`: the top k and
    the log-sum-exp in one kernel pair on the GPU; ties to the lower id)."""
    lse, top_values, top_ids = row_top_logits(logits, top_k)  # two launches on the GPU
    lse = lse[:, None]
    own = logits.gather(1, targets.view(-1, 1)) - lse
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
    return PendingLogprobs.launch(items, inp, logits, emitted, drawn_at).records()


class PendingLogprobs:
    """A step's logprob rows scored on the device, read by `records` (the overlapped path launches
    it with the step and reads it when the step settles: no host wait in between)."""

    def __init__(self, scored: ScoredRows, owners: list[tuple[int, bool]]) -> None:
        self.scored, self.owners = scored, owners  # owners: (item index, is the sampled token)

    @classmethod
    def launch(
        cls,
        items: list[ScheduledItem],
        inp: StepInput,
        logits: torch.Tensor,
        emitted: dict[int, list[int]] | torch.Tensor,
        drawn_at: dict[int, list[int]] | None = None,
    ) -> PendingLogprobs:
        """`step_logprobs`' rows, scored. `emitted`: per item index its tokens, or a device tensor
        of one token per sample item (`inp.sample_items` order: a step launched with overlap)."""
        rows: list[LogprobRow] = []
        targets: list[torch.Tensor] = []
        owners: list[tuple[int, bool]] = []
        for spec in inp.input_logprobs:
            params = items[spec.item].request.params
            ids = items[spec.item].request.token_ids[
                spec.first_token : spec.first_token + len(spec.logit_rows)
            ]
            rows.extend(
                LogprobRow(r, params.top_logprobs_num, params.token_ids_logprob) for r in spec.logit_rows
            )
            targets.append(torch.tensor(ids, dtype=torch.long))
            owners.extend((spec.item, False) for _ in spec.logit_rows)
        for n, (index, sample_rows) in enumerate(zip(inp.sample_items, inp.sample_rows, strict=True)):
            params = items[index].request.params
            if not params.return_logprob:
                continue
            tokens = emitted[n : n + 1] if isinstance(emitted, torch.Tensor) else emitted[index]
            at = (drawn_at or {}).get(index)
            drawn = [sample_rows[r] for r in at] if at is not None else sample_rows[: len(tokens)]
            rows.extend(LogprobRow(r, params.top_logprobs_num, params.token_ids_logprob) for r in drawn)
            targets.append(
                tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long)
            )
            owners.extend((index, True) for _ in range(len(tokens)))
        on_device = [t if t.device == logits.device else to_device(t, logits.device) for t in targets]
        return cls(ScoredRows.launch(logits, rows, torch.cat(on_device) if rows else None), owners)

    def records(self) -> dict[int, StepLogprobs]:
        result: dict[int, StepLogprobs] = {}
        for (index, is_output), record in zip(self.owners, self.scored.records(), strict=True):
            entry = result.setdefault(index, StepLogprobs())
            (entry.outputs if is_output else entry.inputs).append(record)
        return result
