"""Engines sharing a KV store: a second engine in another process reloads a 300-token
prompt's first 256 tokens from ``disk:`` or a real ``redis://`` server and generates the
same greedy tokens; a corrupt entry, or a store written for another dtype or block size, is
a miss with unchanged tokens; an unusable store stops the engine at start-up."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mlafx.runtime.kv_connector import KVConnectorError
from tests.kv_engine_worker import serve
from tests.redis_server import free_port, redis_server
from tests.tiny_models import tiny_llm

REPO = Path(__file__).resolve().parent.parent
PROMPT = [random.Random(0).randrange(2, 256) for _ in range(300)]


@pytest.fixture(params=["disk", "redis"])
def spec(request, tmp_path):
    if request.param == "disk":
        yield f"disk:{tmp_path / 'store'}"
    else:
        with redis_server() as url:
            yield url


def serve_in_new_process(spec: str, prompt: list[int]) -> dict:
    run = subprocess.run(
        [sys.executable, "-m", "tests.kv_engine_worker", spec, ",".join(map(str, prompt))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


def test_a_second_process_reloads_the_prefix(spec):
    cold = serve(spec, PROMPT)  # this process computes and stores the prompt
    assert cold["external_hit_tokens"] == 0 and cold["num_cached_tokens"] == 0
    warm = serve_in_new_process(spec, PROMPT)
    assert warm["external_hit_tokens"] == 256  # one 256-token chunk; the tail is computed
    assert warm["num_cached_tokens"] >= 256
    assert warm["tokens"] == cold["tokens"]


def test_a_corrupt_entry_is_a_miss_with_unchanged_tokens(tmp_path, caplog):
    spec = f"disk:{tmp_path}"
    cold = serve(spec, PROMPT)
    (chunk,) = tmp_path.glob("*/*.safetensors")
    data = bytearray(chunk.read_bytes())
    data[-7] ^= 0x01  # one bit of the last layer's rows
    chunk.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        again = serve(spec, PROMPT)
    assert "checksum mismatch" in caplog.text
    assert again["external_hit_tokens"] == 0 and again["tokens"] == cold["tokens"]


@pytest.mark.parametrize("other", [{"dtype": "bfloat16"}, {"block_size": 4, "num_kv_blocks": 128}])
def test_a_store_of_another_dtype_or_block_size_is_a_miss(tmp_path, other):
    spec = f"disk:{tmp_path}"
    serve(spec, PROMPT)
    assert serve(spec, PROMPT, **other)["external_hit_tokens"] == 0
    assert len(list(tmp_path.iterdir())) == 2  # each cache fingerprint has its own folder


def test_an_unusable_store_fails_at_engine_start_up(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad_specs = {
        "s3://bucket": "expected disk:PATH or redis://HOST:PORT",
        f"disk:{blocker}/store": "cannot be created or written",
        f"redis://127.0.0.1:{free_port()}": "does not answer",
    }
    for bad, message in bad_specs.items():
        with pytest.raises(KVConnectorError, match=message):
            tiny_llm(kv_connector=bad)
