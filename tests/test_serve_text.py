"""`mlafx serve` with a tokenizer: text prompts, stop strings (whole and streamed), text
logprobs and seeded sampling, against `mlafx.LLM` on the same checkpoint. The app runs in a
real uvicorn server on a thread of this process."""

from __future__ import annotations

import httpx
import pytest

import mlafx
from tests.live_server import live_server
from tests.tiny_models import WORDS, write_tiny_checkpoint_with_tokenizer

MODEL = "tiny-text"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_serve_text")
    return write_tiny_checkpoint_with_tokenizer(directory)


def engine(checkpoint) -> mlafx.LLM:
    return mlafx.LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=64, compile=False, progress=False
    )


@pytest.fixture(scope="module")
def offline(checkpoint):
    return engine(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    with live_server(engine(checkpoint), MODEL) as url:
        yield url


def complete(url: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream_texts(url: str, **body) -> tuple[str, str | None]:
    """The streamed text, concatenated, and the last finish reason."""
    text, finish = "", None
    payload = {"model": MODEL, "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                (choice,) = httpx.Response(200, content=line[6:]).json()["choices"]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def blocks_in_use(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("mlafx_kv_cache_blocks_in_use "):
            return float(line.split()[1])
    raise AssertionError("no mlafx_kv_cache_blocks_in_use in /metrics")


PROMPT = "w3 w4 w5 w17 w9"
GREEDY = {"temperature": 0, "ignore_eos": True}


def test_text_prompts_match_the_offline_engine(server, offline):
    want = offline.generate([PROMPT, "w8 w8"], mlafx.SamplingParams(max_tokens=6, ignore_eos=True))
    body = complete(server, prompt=[PROMPT, "w8 w8"], max_tokens=6, **GREEDY)
    for choice, out in zip(body["choices"], want, strict=True):
        assert choice["text"] == out.outputs[0].text
        assert choice["token_ids"] == out.outputs[0].token_ids
    assert body["usage"]["prompt_tokens"] == 5 + 2


def test_logprobs_show_tokens_as_text(server):
    (choice,) = complete(server, prompt=PROMPT, max_tokens=4, logprobs=2, **GREEDY)["choices"]
    logprobs = choice["logprobs"]
    # each token is its exact share of the text (the word-level decoder joins with spaces)
    assert [t.strip() for t in logprobs["tokens"]] == [WORDS[t] for t in choice["token_ids"]]
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert all(
        len(top) == 2 and token.strip() in top
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True)
    )
    assert logprobs["text_offset"][0] == 0 and len(logprobs["token_logprobs"]) == 4


def test_stop_string_ends_the_text_before_it_and_frees_the_request(server, offline):
    (out,) = offline.generate(PROMPT, mlafx.SamplingParams(max_tokens=12, ignore_eos=True))
    full = out.outputs[0].text
    stop = WORDS[out.outputs[0].token_ids[3]]
    expected = full[: full.find(stop)]
    (choice,) = complete(server, prompt=PROMPT, max_tokens=12, stop=[stop, "zz"], **GREEDY)[
        "choices"
    ]
    assert choice["text"] == expected and choice["finish_reason"] == "stop"
    assert len(choice["token_ids"]) < 12  # the engine request was stopped early
    assert stream_texts(server, prompt=PROMPT, max_tokens=12, stop=stop, **GREEDY) == (
        expected,
        "stop",
    )
    assert blocks_in_use(server) == 0


def test_streamed_text_equals_the_whole_response(server):
    whole = complete(server, prompt=PROMPT, max_tokens=10, **GREEDY)["choices"][0]
    assert stream_texts(server, prompt=PROMPT, max_tokens=10, **GREEDY) == (
        whole["text"],
        "length",
    )


def test_seeded_sampling_is_reproducible_and_matches_the_offline_engine(server, offline):
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 7, "ignore_eos": True}
    first = complete(server, prompt=PROMPT, max_tokens=8, **params)["choices"][0]
    second = complete(server, prompt=PROMPT, max_tokens=8, **params)["choices"][0]
    (out,) = offline.generate(
        PROMPT,
        mlafx.SamplingParams(
            max_tokens=8, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True
        ),
    )
    assert first["token_ids"] == second["token_ids"] == out.outputs[0].token_ids
