"""Run the app with uvicorn on a socket bound up front: a busy port fails before the (slow)
model load, and ``port=0`` works (the bound address is printed)."""

from __future__ import annotations

import socket

import uvicorn

from mlafx.runtime import LLM
from mlafx.serve.app import create_app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(llm: LLM, sock: socket.socket, *, model_name: str, log_level: str = "info") -> None:
    """Serve ``llm`` on the listening ``sock`` (see ``bind``) until Ctrl-C / SIGTERM, then
    close both. Prints ``mlafx serve: http://HOST:PORT (model NAME)`` when it starts."""
    bound_host, bound_port = sock.getsockname()[:2]
    app = create_app(llm, model_name)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(f"mlafx serve: http://{shown}:{bound_port} (model {model_name})", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        sock.close()
        llm.close()
