"""Turn a scheduled batch into the model's input tensors, built on the host and copied once.

Besides ids, positions and the attention layout, it decides which token rows need logits: the last
row of each request that completes its known tokens (to sample), and prompt rows whose next token's
input logprob was asked for. Everything else skips the lm_head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.backend import AttentionBatch
from specserve.engine.request import Request
from specserve.engine.scheduler import ScheduledItem


@dataclass(frozen=True)
class InputLogprobRows:
    """Rows of the logits tensor that score prompt tokens `first_token ...` of one request."""

    item: int
    first_token: int
    logit_rows: range


@dataclass(frozen=True)
class StepInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionBatch
    logit_rows: torch.Tensor  # [R] token rows whose logits are computed
    sample_items: tuple[int, ...]  # items that sample (verify) tokens, in logits-row order
    # Per sample item, its rows of the logits tensor: the last known token, then each draft token.
    sample_rows: tuple[range, ...]
    sample_logit_rows: torch.Tensor  # [S] every sample row, concatenated, on the device
    input_logprobs: tuple[InputLogprobRows, ...]


def build_step_input(items: list[ScheduledItem], page_size: int, device: torch.device) -> StepInput:
    ids: list[int] = []
    logit_rows: list[int] = []
    sample_items: list[int] = []
    sample_rows: list[range] = []
    input_lp: list[InputLogprobRows] = []
    for index, item in enumerate(items):
        req, offset = item.request, len(ids)
        ids.extend(req.token_ids[item.start : item.start + item.num_known])
        ids.extend(item.draft)
        rows = _input_logprob_rows(item)
        if rows is not None:
            first_token, ctx_rows = rows
            input_lp.append(
                InputLogprobRows(index, first_token, range(len(logit_rows), len(logit_rows) + len(ctx_rows)))
            )
            logit_rows.extend(offset + r - item.start for r in ctx_rows)
        if item.completes and not req.prefill_only:
            sample_items.append(index)
            sample_rows.append(range(len(logit_rows), len(logit_rows) + 1 + len(item.draft)))
            logit_rows.extend(range(offset + item.num_known - 1, offset + item.num_tokens))
    flat_sample_rows = [r for rows in sample_rows for r in rows]
    (input_ids, rows, sample_rows_t), pos, attention = _batch_tensors(
        [item.request for item in items],
        [item.start for item in items],
        [item.num_tokens for item in items],
        [ids, logit_rows, flat_sample_rows],
        page_size,
        device,
    )
    return StepInput(
        input_ids=input_ids,
        positions=pos,
        attention=attention,
        logit_rows=rows,
        sample_items=tuple(sample_items),
        sample_rows=tuple(sample_rows),
        sample_logit_rows=sample_rows_t,
        input_logprobs=tuple(input_lp),
    )


def _input_logprob_rows(item: ScheduledItem) -> tuple[int, range] | None:
    """Context rows p in this chunk whose logits score prompt token p + 1 (still unrecorded)."""
    next_token = item.request.next_input_logprob_index
    if next_token is None:
        return None
    first_row = max(item.start, next_token - 1)
    last_row = min(item.end, item.request.prompt_len - 1)
    if first_row >= last_row:
        return None
    return first_row + 1, range(first_row, last_row)


def _batch_tensors(
    requests: list[Request],
    starts: list[int],
    query_lens: list[int],
    extra: list,
    page_size: int,
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor, AttentionBatch]:
    """Positions and the attention layout of requests computing `query_lens` tokens from `starts` on,
    copied to the device in one transfer together with the caller's `extra` int arrays."""
    ctx = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(starts, query_lens, strict=True)]
    slots = [
        np.asarray(r.pages, dtype=np.int64)[c // page_size] * page_size + c % page_size
        for r, c in zip(requests, ctx, strict=True)
    ]
    seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
    host = [
        *extra,
        np.concatenate(ctx),
        np.concatenate([[0], np.cumsum(query_lens)]),
        seq_lens,
        np.concatenate(slots),
        _page_table(requests, seq_lens, page_size),
    ]
    *extras, pos, query_start, seq_lens_t, slot_mapping, table = _to_device(host, device)
    attention = AttentionBatch(
        query_start=query_start,
        seq_lens=seq_lens_t,
        slot_mapping=slot_mapping,
        page_table=table,
        page_size=page_size,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return extras, pos, attention


def _page_table(requests: list[Request], seq_lens: list[int], page_size: int) -> np.ndarray:
    max_pages = max(-(-s // page_size) for s in seq_lens)
    table = np.zeros((len(requests), max_pages), dtype=np.int64)
    for row, (req, seq_len) in enumerate(zip(requests, seq_lens, strict=True)):
        pages = req.pages[: -(-seq_len // page_size)]
        table[row, : len(pages)] = pages
    return table


def _to_device(arrays: list, device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy (from pinned memory on GPU) for every int64 input of the step."""
    flat = [np.asarray(a, dtype=np.int64) for a in arrays]
    host = torch.from_numpy(np.concatenate([a.reshape(-1) for a in flat]))
    if device.type == "cuda":
        host = host.pin_memory()
    buffer = host.to(device, non_blocking=True)
    out, offset = [], 0
    for a in flat:
        out.append(buffer[offset : offset + a.size].view(a.shape))
        offset += a.size
    return out


@dataclass(frozen=True)
class DraftInput:
    """One drafter forward: each request feeds `tokens` at positions from `start` on."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionBatch
    last_rows: torch.Tensor  # [B] the row of each request's last fed token


def build_draft_input(
    feeds: list[tuple[Request, int, list[int]]], page_size: int, device: torch.device
) -> DraftInput:
    """Inputs for a drafter's own forward over (request, start position, tokens) — catch-up or one
    draft step. The drafter's KV cache shares the target's page layout, so slots come from the same pages."""
    ids = [t for _, _, tokens in feeds for t in tokens]
    query_lens = [len(tokens) for _, _, tokens in feeds]
    (input_ids, last), pos, attention = _batch_tensors(
        [req for req, _, _ in feeds],
        [start for _, start, _ in feeds],
        query_lens,
        [ids, np.cumsum(query_lens) - 1],
        page_size,
        device,
    )
    return DraftInput(input_ids, pos, attention, last)
