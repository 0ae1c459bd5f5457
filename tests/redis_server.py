"""A throw-away real ``redis-server`` on 127.0.0.1 for tests (Debian's package, installed by
``make system-deps``): a free port, no persistence, stopped on exit."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis

from tests.system_tools import require

START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run ``redis-server`` for the ``with`` block; yields its URL ``redis://127.0.0.1:N``."""
    binary = require("redis-server")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mlafx-redis-") as workdir:
        log_path = f"{workdir}/redis.log"
        # fmt: off
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", workdir, "--logfile", log_path]
        # fmt: on
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        try:
            _wait_until_ready(proc, port, log_path)
            yield f"redis://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_until_ready(proc: subprocess.Popen, port: int, log_path: str) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}: {_tail(log_path)}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"redis-server not ready on port {port} after {START_TIMEOUT_S} s: "
                        f"{_tail(log_path)}"
                    ) from None
                time.sleep(0.05)
    finally:
        client.close()


def _tail(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()[-2000:]
    except OSError:
        return "(no log)"
