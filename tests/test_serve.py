"""`mlafx serve` end to end: a real server (the CLI, in a subprocess, on a free loopback
port) serving the tiny model (fp32, reference step), checked against `mlafx.LLM` offline."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from bench.serve_load import ServerProcess, random_prompts, run_load, server_flags
from tests.engine_compare import reference_alone
from tests.greedy_compare import compare_greedy

MODEL = "deepseek-v2-lite"
MAX_MODEL_LEN = 512
LONG_PROMPT = [(17 * i + 3) % 250 + 2 for i in range(300)]
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server():
    flags = server_flags("tiny", compile=False) + [
        "--block-size",
        str(BLOCK_SIZE),
        "--num-kv-blocks",
        "256",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]
    process = ServerProcess(flags, start_timeout=120)
    try:
        yield process.url
    finally:
        assert process.stop() == 0, "mlafx serve did not exit cleanly on Ctrl-C"


def metrics(url: str) -> dict[str, float]:
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name.removeprefix("mlafx_")] = float(value)
    return values


def wait_for(url: str, condition, what: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        if condition(values):
            return values
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {values}"
        time.sleep(0.05)


def completion_body(prompt, max_tokens: int = 8, **extra) -> dict:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        **extra,
    }


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as http:
        return await asyncio.gather(*(http.post(f"{url}/v1/completions", json=b) for b in bodies))


async def stream_chunks(url: str, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_health_and_models(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    (model,) = httpx.get(f"{server}/v1/models").json()["data"]
    assert model["id"] == MODEL and model["max_model_len"] == MAX_MODEL_LEN


def test_concurrent_requests_match_offline_llm_and_prefix_hit_shows_in_metrics(server):
    prompts = [LONG_PROMPT, *random_prompts(4, 3, 60, seed=1)]
    streamed_prompt = random_prompts(1, 20, 20, seed=2)[0]
    max_tokens = 8
    refs = reference_alone([*prompts, streamed_prompt, LONG_PROMPT], max_tokens, BLOCK_SIZE)

    async def first_wave():
        return await asyncio.gather(
            post_all(server, [completion_body(p, max_tokens) for p in prompts]),
            stream_chunks(
                server,
                completion_body(
                    streamed_prompt, max_tokens, stream=True, stream_options={"include_usage": True}
                ),
            ),
        )

    responses, events = asyncio.run(first_wave())
    results = []
    for response in responses:
        assert response.status_code == 200, response.text
        (choice,) = response.json()["choices"]
        results.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
        assert choice["finish_reason"] == "length"
    # the stream: one chunk per token (the last one finishing), a usage chunk, [DONE]
    assert events[-1] == "[DONE]"
    *token_chunks, usage_chunk, _ = events
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 8
    assert [c["choices"][0]["finish_reason"] for c in token_chunks] == [None] * 7 + ["length"]
    results.append(
        (
            [t for c in token_chunks for t in c["choices"][0]["token_ids"]],
            [lp for c in token_chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]],
        )
    )
    hits_before = metrics(server)["prefix_cache_hit_tokens_total"]
    (again,) = asyncio.run(post_all(server, [completion_body(LONG_PROMPT, max_tokens)]))
    assert again.status_code == 200
    body = again.json()
    (choice,) = body["choices"]
    results.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    # every prompt token but the last came from the prefix cache (whole blocks, then the
    # leading rows of the block holding the last token)
    cached = len(LONG_PROMPT) - 1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert body["usage"]["prompt_tokens"] == 300 and body["usage"]["completion_tokens"] == 8
    after = metrics(server)
    assert after["prefix_cache_hit_tokens_total"] - hits_before == cached
    assert after["prefix_cache_hit_rate"] > 0
    for i, (ref, (tokens, logprobs)) in enumerate(zip(refs, results, strict=True)):
        compare_greedy(ref.tokens, ref.logprobs, tokens, logprobs, label=f"request {i}")


def test_several_prompts_in_one_request(server):
    prompts = random_prompts(3, 2, 10, seed=3)
    (response,) = asyncio.run(post_all(server, [completion_body(prompts, 4)]))
    assert response.status_code == 200
    body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 4 for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


BAD_REQUESTS = {
    "malformed JSON": (b'{"prompt": [5, 6', "json_invalid"),
    "unknown field": (json.dumps({"prompt": [5], "best_of_everything": 1}), "unknown_field"),
    "out-of-vocab token id": (json.dumps({"prompt": [5, 256]}), None),
    "negative token id": (json.dumps({"prompt": [5, -1]}), None),
    "prompt too long": (json.dumps({"prompt": [5] * MAX_MODEL_LEN}), None),
    "max_tokens 0": (json.dumps({"prompt": [5], "max_tokens": 0}), None),
    "max_tokens negative": (json.dumps({"prompt": [5], "max_tokens": -3}), None),
    "text without a tokenizer": (json.dumps({"prompt": "hello"}), None),
    "stop strings without a tokenizer": (json.dumps({"prompt": [5], "stop": ["x"]}), None),
    "empty prompt": (json.dumps({"prompt": []}), None),
    "missing prompt": (json.dumps({"max_tokens": 3}), "missing_field"),
    "prompt of floats": (json.dumps({"prompt": [1.5, 2]}), None),
    "temperature negative": (json.dumps({"prompt": [5], "temperature": -1}), None),
    "top_p above 1": (json.dumps({"prompt": [5], "top_p": 1.5}), None),
    "top_k 0": (json.dumps({"prompt": [5], "top_k": 0}), None),
    "n 0": (json.dumps({"prompt": [5], "n": 0}), None),
    "best_of below n": (json.dumps({"prompt": [5], "n": 3, "best_of": 2}), None),
    "suffix": (json.dumps({"prompt": [5], "suffix": "x"}), None),
    "seed past 2**64": (json.dumps({"prompt": [5], "seed": 2**64}), None),
    "stream_options without stream": (
        json.dumps({"prompt": [5], "stream_options": {"include_usage": True}}),
        None,
    ),
    "a JSON array": (json.dumps([1, 2]), None),
}


@pytest.mark.parametrize("kind", list(BAD_REQUESTS))
def test_bad_requests_get_400_with_an_openai_error_body(server, kind):
    content, code = BAD_REQUESTS[kind]
    response = httpx.post(
        f"{server}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    if code is not None:
        assert error["code"] == code
    # the server goes on serving
    ok = httpx.post(f"{server}/v1/completions", json=completion_body([5, 6], 2), timeout=60)
    assert ok.status_code == 200


def test_unknown_model_and_route_are_404(server):
    response = httpx.post(f"{server}/v1/completions", json={"prompt": [5], "model": "gpt-9"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{server}/v1/nothing").json()["error"]["type"] == "invalid_request_error"


def raw_post(url: str, body: dict) -> socket.socket:
    """Send a completion request on a raw socket (so the test decides when it closes)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "waiting"])
def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, stream):
    baseline = wait_for(server, lambda m: m["num_requests_running"] == 0, "an idle engine")
    body = completion_body(list(range(2, 40)), MAX_MODEL_LEN - 40, stream=stream)
    sock = raw_post(server, body)
    try:
        if stream:  # read until the first event arrived: the request is running
            received = b""
            while b"data: " not in received:
                chunk = sock.recv(4096)
                assert chunk, f"connection closed early: {received!r}"
                received += chunk
        running = wait_for(
            server, lambda m: m["num_requests_running"] == 1, "the request to run", 60
        )
        assert running["kv_cache_blocks_in_use"] > baseline["kv_cache_blocks_in_use"]
    finally:
        sock.close()
    after = wait_for(
        server,
        lambda m: (
            m["requests_aborted_total"] == baseline["requests_aborted_total"] + 1
            and m["kv_cache_blocks_in_use"] == baseline["kv_cache_blocks_in_use"]
        ),
        "the abort to free the request's blocks",
    )
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
    # generated far fewer tokens than asked: it was stopped, not finished
    assert (
        after["generation_tokens_total"] - baseline["generation_tokens_total"] < body["max_tokens"]
    )


def test_bounded_load_200_requests_from_16_clients(server):
    prompts = random_prompts(200, 4, 48, seed=4)
    report = run_load(server, MODEL, prompts, concurrency=16, max_tokens=4)
    print(f"\nserve load (tiny model, reference step): {report.summary()}")
    assert report.errors == []
    assert len(report.latencies_s) == 200 and report.output_tokens == 200 * 4
    values = metrics(server)
    assert values["num_requests_running"] == 0 and values["kv_cache_blocks_in_use"] == 0


def test_a_busy_port_fails_before_the_model_loads(capsys):
    from mlafx.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--no-compile", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
