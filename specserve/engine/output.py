"""Build what a caller sees of a request: text, ids, finish reason and the native `meta_info`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specserve.engine.request import LogprobRecord, Request
from specserve.engine.text import TextState
from specserve.types import RequestOutput, TokenLogprobs

TokenText = Callable[[int], str]


def make_output(req: Request, text: TextState, token_text: TokenText, delta_ids: list[int]) -> RequestOutput:
    reason = req.finish_reason
    return RequestOutput(
        request_id=req.request_id,
        text=text.text,
        token_ids=req.output_ids,
        finished=req.finished,
        finish_reason=reason["type"] if reason else None,
        meta=_meta(req, token_text),
        delta_text=text.take_delta(),
        delta_token_ids=delta_ids,
        delta_logprobs=_delta_logprobs(req, token_text, len(delta_ids), text),
    )


def _entry(token_text: TokenText, logprob: float | None, token_id: int) -> list:
    return [logprob, token_id, token_text(token_id)]


def _entries(token_text: TokenText, pairs: list[tuple[int, float]] | None) -> list[list]:
    return [_entry(token_text, lp, t) for t, lp in pairs or []]


def _delta_logprobs(
    req: Request, token_text: TokenText, num_delta: int, text: TextState
) -> list[TokenLogprobs]:
    """Output logprobs of the last `num_delta` tokens (each token's record is appended with it),
    with where each token's text starts."""
    if not (req.params.return_logprob and num_delta):
        return []
    first = len(req.output_logprobs) - num_delta
    return [
        TokenLogprobs(
            _entry(token_text, r.logprob, r.token_id),
            _entries(token_text, r.top),
            _entries(token_text, r.chosen),
            text.start_of(first + i),
        )
        for i, r in enumerate(req.output_logprobs[-num_delta:])
    ]


def _meta(req: Request, token_text: TokenText) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.request_id,
        "finish_reason": req.finish_reason,
        "prompt_tokens": req.prompt_len,
        "completion_tokens": req.num_output,
        "cached_tokens": req.cached_tokens,
    }
    if req.spec_verify_ct:
        meta["spec_verify_ct"] = req.spec_verify_ct
        meta["spec_accept_length"] = req.num_output / req.spec_verify_ct
        meta["spec_accept_histogram"] = list(req.spec_accept_histogram)
        meta["spec_draft_tokens"] = req.spec_draft_tokens
        meta["spec_accepted_tokens"] = req.spec_accepted_tokens
    if req.finished and req.finish_time is not None:
        meta["e2e_latency"] = req.finish_time - req.arrival_time
    if req.params.return_logprob and req.finished:
        meta.update(_logprob_meta("input", req.input_logprobs, req, token_text))
        meta.update(_logprob_meta("output", req.output_logprobs, req, token_text))
    return meta


def _logprob_meta(
    side: str, records: list[LogprobRecord], req: Request, token_text: TokenText
) -> dict[str, Any]:
    fields: dict[str, Any] = {
        f"{side}_token_logprobs": [_entry(token_text, r.logprob, r.token_id) for r in records]
    }
    if req.params.top_logprobs_num > 0:
        fields[f"{side}_top_logprobs"] = [_entries(token_text, r.top) for r in records]
    if req.params.token_ids_logprob is not None:
        fields[f"{side}_token_ids_logprobs"] = [_entries(token_text, r.chosen) for r in records]
    return fields
