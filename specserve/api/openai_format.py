"""Engine outputs as OpenAI bodies: choices, chunks, logprobs and usage.

Choice i of a request is engine request i (prompt-major: prompt p, sample j is p x n + j).
Logprob entries come in the native `[logprob, token_id, text]` form (`TokenLogprobs`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.api.openai_schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from specserve.api.streams import Finished, Opened, merge
from specserve.types import RequestOutput, TokenLogprobs

T = TypeVar("T")


@dataclass(frozen=True)
class Head:
    """What every body of one request repeats, and `n` (choices per prompt)."""

    id: str
    created: int
    model: str
    n: int

    def body(self, cls: type[T], choices: list, used: Usage | None) -> T:
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=used)


def usage(finals: Sequence[RequestOutput], n: int) -> Usage:
    """Each prompt counted once (its first choice's figures), completions over every choice."""
    firsts = finals[::n]
    prompt = sum(o.meta.get("prompt_tokens", 0) for o in firsts)
    cached = sum(o.meta.get("cached_tokens", 0) for o in firsts)
    completion = sum(len(o.token_ids) for o in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


# ---- completions --------------------------------------------------------------------------------


def completion_logprobs(lps: Sequence[TokenLogprobs], top: bool, offset: int = 0) -> CompletionLogprobs:
    """`text_offset` from where the engine says each token's text starts; else (an engine that
    does not say) the pieces' lengths from `offset` on, which run past the text for a character of
    several tokens and for skipped special tokens."""
    offsets = []
    for lp in lps:
        offsets.append(lp.offset if lp.offset is not None else offset)
        offset += len(lp.token[2])
    return CompletionLogprobs(
        tokens=[lp.token[2] for lp in lps],
        token_logprobs=[lp.token[0] for lp in lps],
        top_logprobs=[_top_dict(lp.top) for lp in lps] if top else None,
        text_offset=offsets,
    )


def _top_dict(entries: list[list]) -> dict[str, float]:
    top: dict[str, float] = {}
    for logprob, _, text in entries:
        top.setdefault(text, logprob)  # tokens with one text: the likelier one's
    return top


def completion_response(head: Head, done: Sequence[Finished], top: int | None) -> dict[str, Any]:
    choices = [
        CompletionChoice(
            index=i,
            text=f.output.text,
            logprobs=None if top is None else completion_logprobs(f.logprobs, top > 0),
            finish_reason=f.output.finish_reason,
        )
        for i, f in enumerate(done)
    ]
    return head.body(CompletionResponse, choices, usage([f.output for f in done], head.n)).model_dump()


async def completion_chunks(
    head: Head, opened: Sequence[Opened], top: int | None, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    finals = [o.first for o in opened]
    offsets = [0] * len(opened)
    async for i, out in merge(opened):
        finals[i] = out
        if not (out.delta_text or out.delta_logprobs or out.finished):
            continue
        logprobs = None if top is None else completion_logprobs(out.delta_logprobs, top > 0, offsets[i])
        offsets[i] += len(out.delta_text)
        choice = CompletionChoice(
            index=i, text=out.delta_text, logprobs=logprobs, finish_reason=out.finish_reason
        )
        yield head.body(CompletionResponse, [choice], None).model_dump()
    if include_usage:
        yield head.body(CompletionResponse, [], usage(finals, head.n)).model_dump()


# ---- chat ---------------------------------------------------------------------------------------


def chat_logprobs(lps: Sequence[TokenLogprobs]) -> ChatLogprobs:
    def top(entry: list) -> ChatTopLogprob:
        return ChatTopLogprob(token=entry[2], logprob=entry[0], bytes=list(entry[2].encode()))

    content = [
        ChatTokenLogprob(**top(lp.token).model_dump(), top_logprobs=[top(e) for e in lp.top]) for lp in lps
    ]
    return ChatLogprobs(content=content)


def chat_response(head: Head, done: Sequence[Finished], logprobs: bool) -> dict[str, Any]:
    choices = [
        ChatChoice(
            index=i,
            message=ChatMessageOut(content=f.output.text),
            logprobs=chat_logprobs(f.logprobs) if logprobs else None,
            finish_reason=f.output.finish_reason,
        )
        for i, f in enumerate(done)
    ]
    return head.body(ChatCompletionResponse, choices, usage([f.output for f in done], head.n)).model_dump()


async def chat_chunks(
    head: Head, opened: Sequence[Opened], logprobs: bool, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    finals = [o.first for o in opened]
    started = [False] * len(opened)
    async for i, out in merge(opened):
        finals[i] = out
        if started[i] and not (out.delta_text or out.delta_logprobs or out.finished):
            continue
        delta = ChatDelta(role=None if started[i] else "assistant", content=out.delta_text)
        started[i] = True
        choice = ChatChunkChoice(
            index=i,
            delta=delta,
            logprobs=chat_logprobs(out.delta_logprobs) if logprobs else None,
            finish_reason=out.finish_reason,
        )
        yield head.body(ChatCompletionChunk, [choice], None).model_dump()
    if include_usage:
        yield head.body(ChatCompletionChunk, [], usage(finals, head.n)).model_dump()
