"""The ASGI app: OpenAI-compatible routes over one ``LLM``.

- ``POST /v1/completions``: see ``completions``;
- ``POST /v1/chat/completions``: see ``chat``;
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one served model;
- ``GET /health``: 200 while the engine thread runs, else 503;
- ``GET /metrics``: Prometheus text (see ``prometheus``).

The app's lifespan starts the engine thread and stops it (aborting what is in flight) at
shutdown. Every error is an OpenAI-style body (see ``errors``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import mlafx
from mlafx.runtime import LLM
from mlafx.serve import prometheus
from mlafx.serve.chat import create_chat_completion
from mlafx.serve.completions import create_completion
from mlafx.serve.engine_loop import EngineLoop
from mlafx.serve.errors import (
    ERROR_RESPONSES,
    SERVER_ERROR,
    APIError,
    error_body,
    install_error_handlers,
)
from mlafx.serve.protocol import FIELD_SHAPES, ChatCompletionRequest, CompletionRequest

# what the generation routes answer, for the OpenAPI document
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The whole response (JSON), or with stream=true server-sent events",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # OpenAPI 3.1: the schema of one event (data: a JSON chunk, or "[DONE]")
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {
                        "data": {"type": "string"},
                        "event": {"type": "string"},
                        "id": {"type": "string"},
                        "retry": {"type": "integer"},
                    },
                }
            },
        },
    },
    **ERROR_RESPONSES,
}


class PrometheusResponse(PlainTextResponse):
    media_type = prometheus.CONTENT_TYPE


def create_app(llm: LLM, model_name: str) -> FastAPI:
    """An app serving ``llm`` under ``model_name``; the app owns the engine thread from
    start-up to shutdown (the caller keeps ``llm`` and closes it afterwards)."""
    engine = EngineLoop(llm)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="mlafx", version=mlafx.__version__, lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app, FIELD_SHAPES)

    @app.post("/v1/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, engine, model_name)

    @app.post("/v1/chat/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, engine, model_name)

    card = {
        "id": model_name,
        "object": "model",
        "created": created,
        "owned_by": "mlafx",
        "max_model_len": llm.max_model_len,
    }

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(
                f"the model {model_id!r} does not exist (this server serves {model_name!r})",
                status=404,
                param="model",
                code="model_not_found",
            )
        return card

    @app.get("/health", responses={503: ERROR_RESPONSES[500]})
    async def health() -> JSONResponse:
        if not engine.alive:
            body = error_body("the engine thread is not running", SERVER_ERROR)
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PrometheusResponse, responses=ERROR_RESPONSES)
    async def metrics() -> PrometheusResponse:
        snapshot = await engine.run(prometheus.engine_snapshot)
        return PrometheusResponse(prometheus.render(snapshot))

    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    return app


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without the 422 it adds to every route with a body or path
    parameter: this server answers a body that fails validation with a 400."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
