"""The ASGI app: OpenAI-compatible routes over one ``LLM``.

- ``POST /v1/completions``: see ``completions``;
- ``GET /v1/models``: the one served model;
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
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import mlafx
from mlafx.runtime import LLM
from mlafx.serve import prometheus
from mlafx.serve.completions import create_completion
from mlafx.serve.engine_loop import EngineLoop
from mlafx.serve.errors import SERVER_ERROR, error_body, install_error_handlers
from mlafx.serve.protocol import FIELD_SHAPES, CompletionRequest


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

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, engine, model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "mlafx",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            body = error_body("the engine thread is not running", SERVER_ERROR)
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        snapshot = await engine.run(prometheus.engine_snapshot)
        return PlainTextResponse(prometheus.render(snapshot), media_type=prometheus.CONTENT_TYPE)

    return app
