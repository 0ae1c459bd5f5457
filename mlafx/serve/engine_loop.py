"""One thread owns the engine; the server's coroutines talk to it through a queue.

``LLM`` is not thread-safe, so every call on it (``add_request``, ``step``,
``abort_request``, metrics) runs on the engine thread. The thread takes commands from an
inbox, runs them, then runs one ``step()`` if any request is unfinished, and repeats; it
sleeps on the inbox while there is nothing to do. Requests that arrive while others run
join the next step: the engine batches them continuously.

A ``Submission`` is one HTTP request's prompts. The engine thread pushes each step's
``RequestOutput`` for them onto the submission's asyncio queue (through
``call_soon_threadsafe``), and the handler awaits them with ``next()``. A handler whose
client went away calls ``abort_unfinished()``, which frees the requests' KV blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mlafx.runtime import LLM, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")
Command = Callable[[], None]
_STOP = object()  # the inbox item that ends the thread


class EngineError(RuntimeError):
    """The engine failed while serving a request (the request is dropped; the server and
    the other requests go on)."""


class Submission:
    """Outputs of one HTTP request's prompts, in arrival order, tagged with the prompt's
    index. Created on the event loop; fed by the engine thread."""

    def __init__(self, engine: EngineLoop, num_prompts: int, num_copies: int = 1) -> None:
        self._engine = engine
        self.num_copies = num_copies  # engine copies per prompt (SamplingParams.num_copies)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._unfinished: set[int] = set(range(num_prompts))

    def _push(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        """Called on the engine thread; dropped if the event loop is gone (nobody waits)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed
            pass

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def next(self) -> tuple[int, RequestOutput]:
        """The next output of any of the prompts: ``(prompt index, output so far)``.
        Raises ``EngineError`` if the engine failed while serving them."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        index, output = item
        if output.finished:
            self._unfinished.discard(index)
        return item

    def abort(self, index: int, copy: int | None = None) -> None:
        """Stop prompt ``index`` (every copy, or copy ``copy``: e.g. a stop string
        matched); outputs already queued should be ignored for what was stopped."""
        if index not in self._unfinished:
            return
        if copy is not None and self.num_copies > 1:
            self._engine.abort(f"{self.request_ids[index]}.{copy}")
            return  # the prompt finishes with its last copy
        self._unfinished.discard(index)
        self._engine.abort(self.request_ids[index])

    def abort_unfinished(self) -> None:
        """Stop every prompt still running (the client is gone). Safe to call twice."""
        for index in sorted(self._unfinished):
            self.abort(index)


class EngineLoop:
    """Runs ``llm`` on a background thread from ``start()`` to ``stop()``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlafx-engine", daemon=True)
        # engine thread only: request id -> (its submission, its prompt index)
        self._routes: dict[str, tuple[Submission, int]] = {}

    # ----- any thread -----
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort whatever is running and end the thread (waits for the current step)."""
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[[LLM], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(llm)`` on the engine thread, between steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.llm))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._inbox.put(command)
        return future

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); returns at once."""
        self._inbox.put(lambda: self._abort(request_id))

    # ----- the event loop -----
    async def run(self, fn: Callable[[LLM], T]) -> T:
        """Await ``fn(llm)`` run on the engine thread."""
        if not self.alive:
            raise EngineError("the engine thread is not running")
        return await asyncio.wrap_future(self.call(fn))

    async def submit(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams
    ) -> Submission:
        """Queue every prompt, or none: the engine's ``ValueError``/``TypeError`` for a bad
        prompt (out-of-vocab ids, too long, text without a tokenizer, ...) is raised here
        and nothing stays queued."""
        submission = Submission(self, len(prompts), params.num_copies)

        def add(llm: LLM) -> list[str]:
            ids: list[str] = []
            try:
                for index, prompt in enumerate(prompts):
                    request_id = llm.add_request(prompt, params, index=index)
                    self._routes[request_id] = (submission, index)
                    ids.append(request_id)
            except BaseException:
                for request_id in ids:
                    self._abort(request_id)
                raise
            return ids

        submission.request_ids = await self.run(add)
        return submission

    # ----- the engine thread -----
    def _abort(self, request_id: str) -> None:
        self._routes.pop(request_id, None)
        self.llm.abort_request(request_id)

    def _run(self) -> None:
        while True:
            busy = self.llm.has_unfinished_requests()
            try:
                item = self._inbox.get(block=not busy)
                while True:
                    if item is _STOP:
                        self._fail_all(EngineError("the server is shutting down"))
                        return
                    self._run_command(item)
                    item = self._inbox.get_nowait()
            except queue.Empty:
                pass
            if self.llm.has_unfinished_requests():
                self._step()

    def _run_command(self, command: Command) -> None:
        """Commands from ``call`` hand their errors to their caller; an abort that fails
        is logged: either way the thread goes on."""
        try:
            command()
        except Exception:
            log.exception("engine command failed")

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as e:
            log.exception("engine step failed; dropping the requests in flight")
            self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            submission, index = route
            if output.finished:
                del self._routes[output.request_id]
            submission._push((index, output))

    def _fail_all(self, error: EngineError) -> None:
        """Abort every routed request and hand ``error`` to its submission."""
        failed = {id(s): s for s, _ in self._routes.values()}
        for request_id in list(self._routes):
            self._run_command(functools.partial(self._abort, request_id))
        for submission in failed.values():
            submission._push(error)
