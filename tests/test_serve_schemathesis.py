"""A bounded schemathesis run (its CLI, at most ~50 s) against the live OpenAPI document of
a server with a tokenizer and a chat template: no 5xx, and every response conforms to the
document (status codes, content types, bodies)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlafx
from tests.live_server import live_server
from tests.tiny_models import write_tiny_chat_checkpoint

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_schema_conformance"
)


def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path):
    checkpoint = write_tiny_chat_checkpoint(tmp_path / "model")
    llm = mlafx.LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=256, compile=False, progress=False
    )
    command = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert command is not None, "schemathesis (a dev dependency) is not installed"
    with live_server(llm, "tiny") as url:
        done = subprocess.run(
            [
                command,
                "run",
                f"{url}/openapi.json",
                "--checks",
                CHECKS,
                "--max-examples",
                "30",
                "--max-time",
                "50",
                "--request-timeout",
                "30",
                "--seed",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout.split("SUMMARY")[-1]
