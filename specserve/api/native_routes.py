"""Native, SGLang-compatible routes: `/generate`, `/flush_cache`, `/health`, `/metrics`."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specserve.api.client import EngineClient
from specserve.api.native_schemas import GenerateRequest, GenerateResponse
from specserve.api.sse import STREAMED, EventStreamResponse
from specserve.api.streams import Job, Opened, collect, merge, start, until_disconnect, with_field_errors
from specserve.metrics import HttpMetrics, merge_expositions
from specserve.types import RequestOutput, TokenLogprobs


def native_router(client: EngineClient, http_metrics: HttpMetrics) -> APIRouter:
    router = APIRouter(tags=["native"])

    @router.post("/generate", response_model=GenerateResponse | list[GenerateResponse], responses=STREAMED)
    async def generate(body: GenerateRequest, http: Request):
        fields = body.engine_fields()
        jobs = with_field_errors(fields, lambda: _jobs(body))
        opened = await start(client, jobs, fields)
        if body.stream:
            return EventStreamResponse(_chunks(body, opened))
        done = await until_disconnect(http, collect(opened))
        results = [_result(f.output) for f in done]
        return results if body.batched else results[0]

    @router.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        ok = await client.flush_cache()
        return {
            "success": ok,
            "message": "Cache flushed." if ok else "Cache not flushed: requests are running.",
        }

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", **await client.health()})

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        # This app's own HTTP counts first: they win over an older copy of them among the client's.
        text = merge_expositions([http_metrics.exposition(), await client.metrics_text()])
        return PlainTextResponse(text, media_type=CONTENT_TYPE_LATEST)

    return router


def _jobs(body: GenerateRequest) -> list[Job]:
    prompts = body.prompts()
    base = uuid.uuid4().hex
    ids = body.request_ids(len(prompts), lambda i: f"{base}-{i}" if body.batched else base)
    params = body.params_per_prompt(len(prompts))
    return [Job(p, sp, rid) for p, sp, rid in zip(prompts, params, ids, strict=True)]


def _result(
    out: RequestOutput, text: str | None = None, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "text": out.text if text is None else text,
        "output_ids": out.token_ids,
        "meta_info": out.meta if meta is None else meta,
    }


async def _chunks(body: GenerateRequest, opened: Sequence[Opened]) -> AsyncIterator[dict[str, Any]]:
    """SGLang's stream: cumulative text and ids so far, with logprobs so far while running."""
    texts = [""] * len(opened)
    logprobs: list[list[TokenLogprobs]] = [[] for _ in opened]
    async for i, out in merge(opened):
        texts[i] += out.delta_text
        logprobs[i].extend(out.delta_logprobs)
        meta = out.meta
        if body.return_logprob and not out.finished:  # the engine's meta has them only at the end
            meta = {**meta, **_logprobs_so_far(body, logprobs[i])}
        chunk = _result(out, out.text if out.finished else texts[i], meta)
        if body.batched:
            chunk["index"] = i
        yield chunk


def _logprobs_so_far(body: GenerateRequest, lps: list[TokenLogprobs]) -> dict[str, Any]:
    fields: dict[str, Any] = {"output_token_logprobs": [lp.token for lp in lps]}
    if body.top_logprobs_num > 0:
        fields["output_top_logprobs"] = [lp.top for lp in lps]
    if body.token_ids_logprob is not None:
        fields["output_token_ids_logprobs"] = [lp.chosen for lp in lps]
    return fields
