"""``POST /v1/chat/completions``: the messages rendered with the model's chat template
(``runtime/chat_template.py``, as ``transformers``' ``apply_chat_template`` renders them)
and encoded without further special tokens, then generated like a completion.

Response (OpenAI's ``chat.completion``)::

    {"id": "chatcmpl-...", "object": "chat.completion", "created", "model",
     "choices": [{"index": i, "message": {"role": "assistant", "content": str},
                  "logprobs": {"content": [{token, logprob, bytes, top_logprobs}]} | null,
                  "finish_reason": "stop" | "length"}],
     "usage": {...}}

A stream sends ``chat.completion.chunk`` events: per choice first ``delta: {"role":
"assistant", "content": ""}``, then ``delta: {"content": ...}`` pieces, the last with its
``finish_reason``; then the usage chunk if ``stream_options.include_usage``; then
``[DONE]``. A model without a chat template (or tokenizer) is a 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlafx.runtime import LLM
from mlafx.runtime.chat_template import ChatTemplateError
from mlafx.serve.choice import ChoiceDelta, ChoiceState, chat_logprobs
from mlafx.serve.engine_loop import EngineLoop
from mlafx.serve.errors import APIError
from mlafx.serve.generation import (
    Generation,
    check_model,
    engine_params_error,
    prompt_error,
    respond,
)
from mlafx.serve.protocol import ChatCompletionRequest


def _chat_prompt(body: ChatCompletionRequest, llm: LLM) -> tuple[Any, list[int]]:
    """The model's tokenizer and the request's messages rendered by its chat template and
    tokenized; an ``APIError`` when the model cannot chat or the template refuses them."""
    if llm.tokenizer is None or llm.chat_template is None:
        missing = "tokenizer" if llm.tokenizer is None else "chat template"
        raise APIError(
            f"this model has no {missing}, so it cannot chat; use /v1/completions",
            param="messages",
            code="no_chat_template",
        )
    try:
        text = llm.chat_template.render(
            [m.template_dict() for m in body.messages],
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except ChatTemplateError as e:
        raise APIError(str(e), param="messages") from None
    return llm.tokenizer, llm.tokenizer.encode(text, add_special_tokens=False).ids


async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineLoop, model_name: str
) -> JSONResponse | StreamingResponse:
    check_model(body.model, model_name)
    llm = engine.llm
    tokenizer, prompt = _chat_prompt(body, llm)
    try:
        params = body.sampling_params(llm.max_model_len)
    except ValueError as e:
        raise engine_params_error(e) from None
    try:
        submission = await engine.submit([prompt], params)
    except (ValueError, TypeError) as e:
        raise prompt_error(e, "messages") from None
    choices = [
        ChoiceState(body.stop_strings(), tokenizer, body.logprobs, copy) for copy in range(body.n)
    ]
    generation = Generation(submission, choices, n=body.n)
    call_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    top_k = body.top_logprobs or 0
    started: set[int] = set()

    def envelope(kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": call_id,
            "object": kind,
            "created": created,
            "model": model_name,
            "choices": choices,
        }

    def whole(totals: list[ChoiceDelta]) -> dict[str, Any]:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": t.text},
                "logprobs": chat_logprobs(t.logprobs, top_k),
                "finish_reason": t.finish_reason,
            }
            for i, t in enumerate(totals)
        ]
        return {**envelope("chat.completion", choices), "usage": generation.usage()}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any, finish: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return envelope("chat.completion.chunk", [choice])

    def chunks(index: int, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events = []
        if index not in started:
            started.add(index)
            events.append(chunk(index, {"role": "assistant", "content": ""}, None, None))
        if delta.text or delta.logprobs or delta.finish_reason:
            content = {"content": delta.text} if delta.text else {}
            logprobs = chat_logprobs(delta.logprobs, top_k) if delta.logprobs else None
            events.append(chunk(index, content, logprobs, delta.finish_reason))
        return events

    def usage_chunk() -> dict[str, Any]:
        return {**envelope("chat.completion.chunk", []), "usage": generation.usage()}

    return await respond(
        generation,
        request,
        stream=body.stream,
        whole=whole,
        chunks=chunks,
        usage_chunk=usage_chunk if body.include_usage() else None,
    )
