"""An app served by a real uvicorn server on a thread of the test process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

import mlafx
from mlafx.serve import create_app
from mlafx.serve.server import bind


@contextmanager
def live_server(llm: mlafx.LLM, model_name: str) -> Iterator[str]:
    """Serve ``llm`` as ``model_name`` on a free loopback port; yields the base URL."""
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(llm, model_name), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if uv.started:
            break
        thread.join(0.05)
    assert uv.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()
