"""Every error the HTTP API returns, in one JSON shape (OpenAI's), with the field at fault named.

`{"error": {"message", "type", "param", "code"}}`: pydantic validation errors name the field path,
ValueErrors of `SamplingParams` and the engine ("field: message") are mapped to the API's own field
names, `EngineOverloaded` is a 429 and `EngineUnavailable` (a failed engine step among them) a 503,
both with Retry-After. Errors log no request content (prompts stay out of logs).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specserve.api.client import EngineOverloaded, EngineUnavailable

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    500: "internal_error",
}
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "bytes"}


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong; for a bad field it starts with the field's name.")
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, ...")
    param: str | None = Field(description="The field at fault (`messages[0].role`), when one is.")
    code: int = Field(description="The HTTP status.")


class ErrorResponse(BaseModel):
    error: ErrorDetail = Field(description="The error.")


def _documented(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# Every route's error responses in its OpenAPI entry. The "4XX" entry also keeps FastAPI from
# documenting its own 422, which this API never sends (a bad field is a 400).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _documented("Bad input: `param` names the field (malformed JSON: no field)."),
    401: _documented("An API key is required and was missing or wrong (only when the server has one)."),
    404: _documented("The model named is not served here."),
    413: _documented("The request body is over the server's limit."),
    429: _documented("The engines' queues are full: retry after `Retry-After` seconds."),
    503: _documented("No engine can serve now (starting, failed, replaced): retry after `Retry-After`."),
    "4XX": _documented("Any other client error, in the same shape."),
}


class ApiError(Exception):
    """An error the routes raise on purpose; rendered by the handler below."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or (INVALID_REQUEST if status == 400 else _TYPES.get(status, INVALID_REQUEST))
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(exc: ValueError, fields: Mapping[str, str | None]) -> ApiError:
    """A "field: message" ValueError (SamplingParams, the engine) as a 400 naming the API's field.

    `fields` maps engine names (`max_new_tokens`, `prompt`, ...) to this API's; unmapped names that
    look like fields pass through as they are.
    """
    text = str(exc)
    name, sep, rest = text.partition(": ")
    if not sep:
        return ApiError(400, text)
    root = name.split("[", 1)[0]
    if root in fields:
        mapped = fields[root]
        param = None if mapped is None else mapped + name[len(root) :]
        return ApiError(400, f"{param or name}: {rest}", param)
    return ApiError(400, text, name if _FIELD.match(name) else None)


def engine_error(exc: Exception) -> ApiError | None:
    """Overload and unavailability as 429 / 503 with Retry-After; None for other exceptions."""
    if isinstance(exc, EngineOverloaded):
        status = 429
    elif isinstance(exc, EngineUnavailable):
        status = 503
    else:
        return None
    retry = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return ApiError(status, str(exc) or type(exc).__name__, headers=retry)


def param_of(loc: Sequence[Any]) -> str | None:
    """A pydantic error location as a field path (`messages[0].role`), union member tags dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            if not parts:
                return None  # a position in a malformed JSON document, not a field
            parts[-1] += f"[{item}]"
        elif isinstance(item, str) and item.isidentifier() and item.islower() and item not in _TYPE_TAGS:
            parts.append(item)
    return ".".join(parts) or None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The error that got deepest: of a union's members, the one the input came closest to. A list
    over its cap, or under its least, goes first: its shape matched a member, and every other member
    fails item by item (65 prompts of ids would otherwise read as "prompt[0]: should be an integer",
    and an empty prompt list as "prompt: should be a valid string")."""
    first = max(
        errors,
        key=lambda e: (e.get("type") in ("too_long", "too_short"), len(e.get("loc", ()))),
        default=None,
    )
    first = first or {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg')}")
    loc = tuple(first.get("loc", ()))
    param = param_of(loc)
    if first.get("type") == "extra_forbidden" and loc:
        # The unknown key as the client spelt it (any string: `Temperature`, `max-tokens`, unicode).
        parent = param_of(loc[:-1])
        param = f"{parent}.{loc[-1]}" if parent else str(loc[-1])
        message = f"{param}: unknown field"
    else:
        # a validator's own words, without pydantic's "Value error, " before them
        msg = str(first.get("msg")).removeprefix("Value error, ")
        message = f"{param or 'body'}: {msg}"
    return ApiError(400, message, param)


def install_error_handlers(app: FastAPI, disconnects: tuple[type[BaseException], ...] = ()) -> None:
    """`disconnects`: exceptions that mean the client went away (besides starlette's
    `ClientDisconnect`): under Ray Serve the proxy cancels the ingress's task, whose next read raises
    Ray's TaskCancelledError, which was logged as a failed request with a 50-line traceback."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(EngineOverloaded)
    @app.exception_handler(EngineUnavailable)
    async def _engine(request: Request, exc: Exception) -> JSONResponse:
        return engine_error(exc).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, (ClientDisconnect, *disconnects)):  # the client left: nothing went wrong here
            log.info("request %s %s: the client disconnected", request.method, request.url.path)
            return ApiError(499, "the client disconnected").response()
        log.exception("request %s %s failed", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}").response()
