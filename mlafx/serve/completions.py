"""``POST /v1/completions``: a request's prompts go to the engine loop; their outputs come
back as one JSON response or, with ``stream=true``, as server-sent events.

Response (OpenAI's ``text_completion``)::

    {"id": "cmpl-...", "object": "text_completion", "created": unix_s, "model": name,
     "choices": [{"index": i, "text": str, "token_ids": [int], "logprobs": {...} | null,
                  "finish_reason": "stop" | "length"}],
     "usage": {"prompt_tokens", "completion_tokens", "total_tokens",
               "prompt_tokens_details": {"cached_tokens"}}}

``token_ids`` (an mlafx extension, like vLLM's) lists the generated ids; ``text`` is empty
when the model has no tokenizer. A stream sends ``data: {chunk}`` events of the same shape
holding each choice's new text and ids (``finish_reason`` null until its last), then, if
``stream_options.include_usage``, a chunk with empty ``choices`` and the usage, then
``data: [DONE]``.

A client that disconnects, while waiting for a whole response or mid-stream, has its
requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlafx.serve.choice import ChoiceDelta, ChoiceState
from mlafx.serve.engine_loop import EngineError, EngineLoop, Submission
from mlafx.serve.errors import SERVER_ERROR, APIError
from mlafx.serve.protocol import CompletionRequest


class Completion:
    """One completion call: its id, choices and the engine submission behind them."""

    def __init__(self, body: CompletionRequest, model_name: str, tokenizer: Any | None) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name
        self.body = body
        num_prompts = len(body.prompts())
        self.choices = [
            ChoiceState(body.stop_strings(), tokenizer, body.logprobs is not None)
            for _ in range(num_prompts)
        ]

    async def next_delta(self, submission: Submission) -> tuple[int, ChoiceDelta] | None:
        """The next change to any choice; None once every choice has finished. A choice
        ended by a stop string has its engine request aborted here."""
        while not all(c.finished for c in self.choices):
            index, output = await submission.next()
            choice = self.choices[index]
            if choice.finished:  # queued before its abort went through
                continue
            delta = choice.update(output)
            if choice.finished and not output.finished:
                submission.abort(index)  # a stop string: the engine would go on
            return index, delta
        return None

    def usage(self) -> dict[str, Any]:
        prompt = sum(c.prompt_tokens for c in self.choices)
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in self.choices)},
        }

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }


def choice_json(index: int, delta: ChoiceDelta) -> dict[str, Any]:
    return {
        "index": index,
        "text": delta.text,
        "token_ids": delta.token_ids,
        "logprobs": delta.logprobs,
        "finish_reason": delta.finish_reason,
    }


def merge(total: ChoiceDelta, delta: ChoiceDelta) -> None:
    total.text += delta.text
    total.token_ids += delta.token_ids
    total.finish_reason = delta.finish_reason
    if delta.logprobs is not None:
        if total.logprobs is None:
            total.logprobs = {key: [] for key in delta.logprobs}
        for key, values in delta.logprobs.items():
            total.logprobs[key] += values


async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineLoop, model_name: str
) -> JSONResponse | StreamingResponse:
    """Validate against the served model, submit, then answer or stream."""
    if body.model is not None and body.model != model_name:
        raise APIError(
            f"the model {body.model!r} does not exist (this server serves {model_name!r})",
            status=404,
            param="model",
            code="model_not_found",
        )
    tokenizer = engine.llm.tokenizer
    if body.stop and tokenizer is None:
        raise APIError(
            "stop strings need a tokenizer and this model has none; use stop_token_ids",
            param="stop",
        )
    params = body.sampling_params(engine.llm.max_model_len)
    completion = Completion(body, model_name, tokenizer)
    try:
        submission = await engine.submit(body.prompts(), params)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param="prompt") from None
    if body.stream:
        return CompletionStream(stream_events(completion, submission), submission)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    collector = asyncio.ensure_future(collect(completion, submission))
    try:
        await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # the client left
            collector.cancel()
            return JSONResponse({}, status_code=499)  # nobody reads it
        try:
            return JSONResponse(collector.result())
        except EngineError as e:
            raise APIError(str(e), status=500, type=SERVER_ERROR) from None
    finally:
        watcher.cancel()
        submission.abort_unfinished()


async def collect(completion: Completion, submission: Submission) -> dict[str, Any]:
    """The whole response, once every choice has finished."""
    totals = [ChoiceDelta() for _ in completion.choices]
    while (step := await completion.next_delta(submission)) is not None:
        index, delta = step
        merge(totals[index], delta)
    return {
        **completion.envelope([choice_json(i, t) for i, t in enumerate(totals)]),
        "usage": completion.usage(),
    }


class CompletionStream(StreamingResponse):
    """Server-sent events whose requests are aborted however the response ends: Starlette
    cancels a stream whose client disconnects, possibly before its first event."""

    def __init__(self, events: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.abort_unfinished()


async def stream_events(completion: Completion, submission: Submission) -> AsyncIterator[str]:
    """The events: a chunk per change of a choice, then usage if asked, then ``[DONE]``;
    an engine failure mid-stream is an error event (the status line is already sent)."""
    try:
        while (step := await completion.next_delta(submission)) is not None:
            index, delta = step
            if delta.text or delta.token_ids or delta.finish_reason:
                yield sse(completion.envelope([choice_json(index, delta)]))
    except EngineError as e:
        yield sse(APIError(str(e), status=500, type=SERVER_ERROR).body())
    else:
        options = completion.body.stream_options
        if options is not None and options.include_usage:
            yield sse({**completion.envelope([]), "usage": completion.usage()})
    yield "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already, so
    the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
