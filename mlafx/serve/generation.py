"""What both endpoints share: an HTTP call's choices fed from its engine submission, and
answering with one JSON body or a stream of server-sent events.

Choice ``p * n + c`` is copy ``c`` of prompt ``p``. With ``best_of > n`` only the final
output counts (the engine keeps the ``n`` best once every copy is done), so stop strings
cut those copies' text at the end instead of stopping them early.

A client that disconnects, while waiting for a whole response or mid-stream, has its
requests aborted, which frees their KV blocks. A choice the engine failed
(``finish_reason "error"``, e.g. non-finite logits) fails its own call with a 500 (an
error event when streaming); no other call sees it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from mlafx.serve.choice import ChoiceDelta, ChoiceState
from mlafx.serve.engine_loop import EngineError, Submission
from mlafx.serve.errors import SERVER_ERROR, APIError


class Generation:
    """One call's choices and the engine submission behind them."""

    def __init__(
        self,
        submission: Submission,
        choices: list[ChoiceState],
        *,
        n: int,
        final_only: bool = False,
    ) -> None:
        self.submission = submission
        self.choices = choices
        self.n = n
        self.final_only = final_only  # best_of > n

    async def next_deltas(self) -> list[tuple[int, ChoiceDelta]] | None:
        """The next changes to any choices; None once every choice has finished. A copy
        ended by a stop string has its engine request aborted here."""
        while not all(c.finished for c in self.choices):
            prompt, output = await self.submission.next()
            if self.final_only and not output.finished:
                continue
            deltas = []
            for copy in range(self.n):
                index = prompt * self.n + copy
                choice = self.choices[index]
                if choice.finished:  # or queued before its abort went through
                    continue
                delta = choice.update(output)
                if delta.error is not None:
                    raise EngineError(f"the engine failed this request: {delta.error}")
                if choice.finished and output.outputs[copy].finish_reason is None:
                    self.submission.abort(prompt, copy)  # a stop string: the engine goes on
                deltas.append((index, delta))
            if deltas:
                return deltas
        return None

    def usage(self) -> dict[str, Any]:
        firsts = self.choices[:: self.n]  # a prompt counts once, whatever its copies
        prompt = sum(c.prompt_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
        }


async def respond(
    generation: Generation,
    request: Request,
    *,
    stream: bool,
    whole: Callable[[list[ChoiceDelta]], dict[str, Any]],
    chunks: Callable[[int, ChoiceDelta], list[dict[str, Any]]],
    usage_chunk: Callable[[], dict[str, Any]] | None,
) -> JSONResponse | StreamingResponse:
    """Answer ``generation``: ``whole(totals)`` is the JSON body once every choice is done;
    streamed, ``chunks(index, delta)`` are the events of each change, then
    ``usage_chunk()`` (if given), then ``[DONE]``."""
    submission = generation.submission
    if stream:
        events = stream_events(generation, chunks, usage_chunk)
        return SubmissionStream(events, submission)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    collector = asyncio.ensure_future(collect(generation))
    try:
        await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
        if not collector.done():  # the client left
            collector.cancel()
            return JSONResponse({}, status_code=499)  # nobody reads it
        try:
            return JSONResponse(whole(collector.result()))
        except EngineError as e:
            raise APIError(str(e), status=500, type=SERVER_ERROR) from None
    finally:
        watcher.cancel()
        submission.abort_unfinished()


async def collect(generation: Generation) -> list[ChoiceDelta]:
    """Every choice's whole delta, once all have finished."""
    totals = [ChoiceDelta() for _ in generation.choices]
    while (step := await generation.next_deltas()) is not None:
        for index, delta in step:
            totals[index].merge(delta)
    return totals


class SubmissionStream(StreamingResponse):
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


async def stream_events(
    generation: Generation,
    chunks: Callable[[int, ChoiceDelta], list[dict[str, Any]]],
    usage_chunk: Callable[[], dict[str, Any]] | None,
) -> AsyncIterator[str]:
    """The events; an engine failure mid-stream is an error event (the status line is
    already sent)."""
    try:
        while (step := await generation.next_deltas()) is not None:
            for index, delta in step:
                for chunk in chunks(index, delta):
                    yield sse(chunk)
    except EngineError as e:
        yield sse(APIError(str(e), status=500, type=SERVER_ERROR).body())
    else:
        if usage_chunk is not None:
            yield sse(usage_chunk())
    yield "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already, so
    the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(
            f"the model {requested!r} does not exist (this server serves {served!r})",
            status=404,
            param="model",
            code="model_not_found",
        )


def engine_params_error(error: ValueError) -> APIError:
    """The engine's refusal of a parameter, naming it (its messages start with the field)."""
    message = str(error)
    return APIError(message, param=message.split(" ", 1)[0])


def prompt_error(error: ValueError | TypeError, param: str = "prompt") -> APIError:
    return APIError(str(error), param=param)
