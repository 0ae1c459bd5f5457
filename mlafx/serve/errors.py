"""OpenAI-style error responses.

Every error the server returns has the body OpenAI's API uses::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

A bad request (malformed JSON, an unknown or ill-typed field, a prompt the engine refuses)
is a 400 with type ``invalid_request_error``; an unknown model or route a 404; a failure
inside the server a 500 with type ``server_error``. The server keeps serving after any of
them.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error to send back as an OpenAI-style body with HTTP ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}


# the error bodies of every route, for the OpenAPI document (422 is never sent: a body that
# fails validation is a 400)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error_response("A bad request: malformed JSON, an unknown or ill-typed field"),
    404: _error_response("An unknown model or route"),
    405: _error_response("A method the route does not take (the Allow header lists them)"),
    500: _error_response("A failure inside the server (this request only)"),
}


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: RequestValidationError, shapes: dict[str, str]) -> APIError:
    """The first problem pydantic found, phrased for a client: which top-level field, and
    why. ``shapes`` describes fields whose type is a union (pydantic's own message would
    name only one of its branches)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    field = loc[0] if loc else None
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        reason = ctx.get("error", first.get("msg", ""))
        return APIError(f"the request body is not valid JSON: {reason}", code="json_invalid")
    if kind == "extra_forbidden":
        return APIError(f"unknown field {field!r}", param=field, code="unknown_field")
    if kind == "missing" and field is None:
        return APIError("the request body is missing: send a JSON object", code="missing_body")
    if kind == "missing":
        return APIError(f"missing required field {field!r}", param=field, code="missing_field")
    message = str(first.get("msg", "invalid value"))
    if kind == "value_error":  # our own validators' words
        message = message.removeprefix("Value error, ")
    elif field in shapes:
        return APIError(f"{field} must be {shapes[field]}", param=field)
    where = f"{'.'.join(loc)}: " if loc else ""
    return APIError(f"{where}{message}", param=field)


def install_error_handlers(app: FastAPI, shapes: dict[str, str]) -> None:
    """Route every error the app can raise to an OpenAI-style body (``shapes``: see
    ``validation_error``)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, shapes).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        response = APIError(str(exc.detail), status=exc.status_code, type=kind).response()
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error serving %s", request.url.path)
        return APIError(
            f"internal error: {type(exc).__name__}: {exc}", status=500, type=SERVER_ERROR
        ).response()
