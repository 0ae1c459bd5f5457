"""``POST /v1/completions``: a request's prompts go to the engine loop; their outputs come
back as one JSON response or, with ``stream=true``, as server-sent events (``generation``).

Response (OpenAI's ``text_completion``)::

    {"id": "cmpl-...", "object": "text_completion", "created": unix_s, "model": name,
     "choices": [{"index": i, "text": str, "token_ids": [int], "logprobs": {...} | null,
                  "finish_reason": "stop" | "length"}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
               "prompt_tokens_details": {"cached_tokens"}}}

Choice ``p * n + c`` is copy ``c`` of prompt ``p``. ``token_ids`` (an mlafx extension, like
vLLM's) lists the generated ids; ``text`` is empty when the model has no tokenizer.
``echo`` puts the prompt's text before the generated text and, with ``logprobs``, its tokens
before the generated ones (the first token's logprob and top_logprobs are null);
``max_tokens: 0`` with ``echo`` scores the prompt without generating (lm-eval's
loglikelihood requests). A stream sends ``data: {chunk}`` events of the same shape holding
each choice's new text and ids (``finish_reason`` null until its last), then, if
``stream_options.include_usage``, a chunk with empty ``choices`` and the usage, then
``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlafx.serve.choice import ChoiceDelta, ChoiceState, completion_logprobs
from mlafx.serve.engine_loop import EngineLoop
from mlafx.serve.errors import APIError
from mlafx.serve.generation import (
    Generation,
    check_model,
    engine_params_error,
    prompt_error,
    respond,
)
from mlafx.serve.protocol import CompletionRequest


async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineLoop, model_name: str
) -> JSONResponse | StreamingResponse:
    """Validate against the served model, submit, then answer or stream."""
    check_model(body.model, model_name)
    if body.suffix is not None:
        raise APIError("suffix is not supported (no fill-in-the-middle)", param="suffix")
    tokenizer = engine.llm.tokenizer
    if body.stop and tokenizer is None:
        raise APIError(
            "stop strings need a tokenizer and this model has none; use stop_token_ids",
            param="stop",
        )
    try:
        params = body.sampling_params(engine.llm.max_model_len)
    except ValueError as e:
        raise engine_params_error(e) from None
    prompts = body.prompts()
    try:
        submission = await engine.submit(prompts, params)
    except (ValueError, TypeError) as e:
        raise prompt_error(e) from None
    n = body.n
    choices = [
        ChoiceState(body.stop_strings(), tokenizer, body.logprobs is not None, copy, body.echo)
        for _ in prompts
        for copy in range(n)
    ]
    generation = Generation(submission, choices, n=n, final_only=params.num_copies > n)
    call_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def envelope(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": call_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
        }

    def whole(totals: list[ChoiceDelta]) -> dict[str, Any]:
        choices = [choice_json(i, t) for i, t in enumerate(totals)]
        return {**envelope(choices), "usage": generation.usage()}

    def chunks(index: int, delta: ChoiceDelta) -> list[dict[str, Any]]:
        if delta.text or delta.token_ids or delta.finish_reason or delta.logprobs:
            return [envelope([choice_json(index, delta)])]
        return []

    def usage_chunk() -> dict[str, Any]:
        return {**envelope([]), "usage": generation.usage()}

    return await respond(
        generation,
        request,
        stream=body.stream,
        whole=whole,
        chunks=chunks,
        usage_chunk=usage_chunk if body.include_usage() else None,
    )


def choice_json(index: int, delta: ChoiceDelta) -> dict[str, Any]:
    return {
        "index": index,
        "text": delta.text,
        "token_ids": delta.token_ids,
        "logprobs": completion_logprobs(delta.logprobs),
        "finish_reason": delta.finish_reason,
    }
