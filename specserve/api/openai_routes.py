"""OpenAI-compatible routes: `/v1/completions`, `/v1/chat/completions`, `/v1/models`."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from specserve.api.client import ChatPrompt, EngineClient, ModelInfo, Prompt
from specserve.api.errors import ApiError
from specserve.api.limits import MAX_REQUESTS
from specserve.api.openai_format import (
    Head,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
)
from specserve.api.openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAISampling,
)
from specserve.api.sse import STREAMED, EventStreamResponse
from specserve.api.streams import Job, collect, start, until_disconnect, with_field_errors


def openai_router(client: EngineClient) -> APIRouter:
    router = APIRouter(tags=["openai"])

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        info = await client.model_info()
        card = ModelCard(id=info.name, created=info.created, max_model_len=info.max_model_len)
        return ModelList(data=[card])

    @router.post("/v1/completions", response_model=CompletionResponse, responses=STREAMED)
    async def completions(body: CompletionRequest, http: Request):
        head = await _head(client, body, "cmpl")
        prompts = body.prompts()
        jobs = with_field_errors(body.engine_fields(), lambda: _jobs(head, body, prompts))
        opened = await start(client, jobs, body.engine_fields())
        if body.stream:
            return EventStreamResponse(completion_chunks(head, opened, body.logprobs, body.include_usage))
        return completion_response(head, await until_disconnect(http, collect(opened)), body.logprobs)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAMED)
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        head = await _head(client, body, "chatcmpl")
        prompt = ChatPrompt(tuple(m.as_template_message() for m in body.messages))
        jobs = with_field_errors(body.engine_fields(), lambda: _jobs(head, body, [prompt]))
        opened = await start(client, jobs, body.engine_fields())
        if body.stream:
            return EventStreamResponse(chat_chunks(head, opened, body.logprobs, body.include_usage))
        return chat_response(head, await until_disconnect(http, collect(opened)), body.logprobs)

    return router


async def _head(client: EngineClient, body: OpenAISampling, prefix: str) -> Head:
    info: ModelInfo = await client.model_info()
    if body.model is not None and body.model != info.name:
        raise ApiError(
            404, f"model: {body.model!r} is not served here; this server has {info.name!r}", "model"
        )
    return Head(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), info.name, body.n)


def _jobs(head: Head, body: CompletionRequest | ChatCompletionRequest, prompts: list[Prompt]) -> list[Job]:
    body.check()
    if len(prompts) * body.n > MAX_REQUESTS:
        raise ValueError(f"n: {len(prompts)} prompts x n={body.n} exceeds {MAX_REQUESTS} choices")
    return [
        Job(prompt, body.sampling_params(j), f"{head.id}-{p * body.n + j}")
        for p, prompt in enumerate(prompts)
        for j in range(body.n)
    ]
