"""Server-sent events: `data: <json>` frames ending with `data: [DONE]`, as OpenAI and SGLang stream."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from specserve.api.errors import ApiError, engine_error

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
# A streaming route's OpenAPI entry: with `stream: true` the 200 is an event stream, not JSON.
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "string",
                    "description": '`data: <chunk JSON>` frames, an error in-band as `data: {"error": ...}`, '
                    "then `data: [DONE]`.",
                }
            }
        },
        "description": "The result; with `stream: true`, server-sent events.",
    }
}


def sse_data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield sse_data(event)
    except Exception as exc:  # the headers are sent: report the failure in-band, then end the stream
        error = engine_error(exc)
        if error is None:
            log.exception("a stream failed")
            error = ApiError(500, f"internal error: {exc}")
        yield sse_data(error.body())
    finally:
        await events.aclose()
    yield DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that closes its event iterator however the stream ends: when a client goes
    away mid-stream the iterator is closed at once, which aborts the requests behind it."""

    def __init__(self, events: AsyncIterator[dict[str, Any]]) -> None:
        super().__init__(
            _frames(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
