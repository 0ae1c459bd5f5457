"""A running ``mlafx serve`` driven by the official ``openai`` SDK: completions and chat,
streamed and not, n, echo + logprobs, stop, seed, penalties; chat prompts rendered as
``transformers``' ``apply_chat_template`` renders them; errors that name the right field;
extreme sampling values next to running streams. Reference: ``mlafx.LLM`` offline on the
same checkpoint."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

import mlafx
from bench.serve_load import ServerProcess
from mlafx.serve import create_app
from tests.tiny_models import tiny_llm, write_tiny_chat_checkpoint

MODEL = "tiny-chat"
PROMPT = "w3 w4 w5 w6"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_chat"))


def engine(checkpoint) -> mlafx.LLM:
    return mlafx.LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=256, compile=False, progress=False
    )


@pytest.fixture(scope="module")
def offline(checkpoint):
    return engine(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
    """A running ``mlafx serve`` (the CLI, in a subprocess) on the checkpoint."""
    flags = ["--model", str(checkpoint), "--served-model-name", MODEL, "--dtype", "float32"]
    flags += ["--no-compile", "--num-kv-blocks", "256", "--log-level", "warning"]
    process = ServerProcess(flags, start_timeout=120)
    try:
        yield process.url
    finally:
        assert process.stop() == 0, "mlafx serve did not exit cleanly on Ctrl-C"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def offline_text(offline, prompt, **params) -> str:
    params.setdefault("ignore_eos", True)
    return offline.generate([prompt], mlafx.SamplingParams(**params))[0].outputs[0].text


def test_completions_whole_and_streamed_match_the_engine(client, offline):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    assert whole.choices[0].text == offline_text(offline, PROMPT, max_tokens=8)
    assert whole.usage.prompt_tokens == 4 and whole.usage.completion_tokens == 8
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True, **GREEDY
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == whole.choices[0].text


def test_n_seeded_copies_match_the_engine(client, offline):
    response = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=1.0, seed=11, **_eos()
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    for i, choice in enumerate(response.choices):
        want = offline_text(offline, PROMPT, max_tokens=6, temperature=1.0, seed=11 + i)
        assert choice.text == want
    assert response.usage.prompt_tokens == 4  # the prompt counts once


def _eos() -> dict:
    return {"extra_body": {"ignore_eos": True}}


def test_echo_logprobs_are_the_engine_prompt_logprobs_and_slice_the_text(client, offline):
    ids = offline.tokenizer.encode(PROMPT).ids
    want = offline.generate([ids], mlafx.SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    for max_tokens in (0, 3):
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1, **GREEDY
        )
        choice = response.choices[0]
        assert choice.text.startswith(PROMPT)
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for i in range(1, len(ids)):
            assert math.isclose(
                logprobs.token_logprobs[i], want.prompt_logprobs[i][ids[i]], abs_tol=1e-5
            )
        for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
            assert choice.text[offset : offset + len(token)] == token
        assert "".join(logprobs.tokens) == choice.text


def test_stop_strings_whole_and_streamed(client, offline):
    text = offline_text(offline, PROMPT, max_tokens=8)
    stop = text.split()[3]
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=8, stop=[stop], **GREEDY)
    whole = client.completions.create(**body).choices[0]
    assert whole.text == text[: text.index(stop)] and whole.finish_reason == "stop"
    streamed = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_penalties_and_bias_reach_the_engine(client, offline):
    biased = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, logit_bias={"42": 100}, **GREEDY
    )
    assert biased.choices[0].text.split() == ["w40"] * 4
    params = dict(max_tokens=8, presence_penalty=1.5, frequency_penalty=0.5)
    penalized = client.completions.create(model=MODEL, prompt=PROMPT, **params, **GREEDY)
    assert penalized.choices[0].text == offline_text(offline, PROMPT, **params)


CONVERSATION = [
    {"role": "system", "content": "w7 w8"},
    {"role": "user", "content": "w20 w21 w22"},
    {"role": "assistant", "content": "w30"},
    {"role": "user", "content": [{"type": "text", "text": "w40"}, {"type": "text", "text": "w41"}]},
]


def transformers_prompt(checkpoint) -> list[int]:
    """The conversation as transformers renders and encodes it (the independent reference;
    its text parts joined with newlines, as the server joins them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [dict(m) for m in CONVERSATION]
    messages[-1]["content"] = "w40\nw41"
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
        "input_ids"
    ]


def test_chat_renders_as_transformers_and_streams_the_same_text(client, offline, checkpoint):
    ids = transformers_prompt(checkpoint)
    want = offline.generate([ids], mlafx.SamplingParams(max_tokens=6, ignore_eos=True))[0]
    body = dict(model=MODEL, messages=CONVERSATION, max_completion_tokens=6, **GREEDY)
    whole = client.chat.completions.create(**body)
    assert whole.object == "chat.completion" and whole.usage.prompt_tokens == len(ids)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == want.outputs[0].text
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(ids) + 6


def test_chat_logprobs_layout(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=CONVERSATION[:2],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    choice = response.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content
    for item in content:
        assert bytes(item.bytes).decode() == item.token
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy: the top


def test_chat_errors_are_400s_naming_the_cause(client):
    with pytest.raises(openai.BadRequestError, match="unknown role: tool"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "tool", "content": "w1", "tool_call_id": "x"}]
        )
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=CONVERSATION[:2])


def test_a_model_without_a_chat_template_is_a_clear_400():
    with TestClient(create_app(tiny_llm(), "plain")) as http:
        response = http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    assert response.status_code == 400
    assert "no tokenizer" in response.json()["error"]["message"]


def test_errors_name_the_prompt_and_the_field(server):
    def error(body, path="/v1/completions"):
        response = httpx.post(f"{server}{path}", json=body, timeout=60)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    bad = error({"prompt": [[3, 4], [5, 999]], "max_tokens": 2})
    assert "prompt 1" in bad["message"] and bad["param"] == "prompt"
    assert error({"prompt": "w1", "seed": 2**64})["param"] == "seed"
    assert error({"prompt": "w1", "logprobs": 21})["param"] == "logprobs"
    assert error({"prompt": "w1", "suffix": "w2"})["param"] == "suffix"
    assert error({"prompt": "w1", "max_tokens": 0})["param"] is None  # needs echo
    assert error({"prompt": "w1", "n": 2, "best_of": 1})["message"].startswith("best_of")
    empty = httpx.post(f"{server}/v1/completions", content=b"", timeout=60)
    assert empty.status_code == 400 and "body is missing" in empty.json()["error"]["message"]
    for field in ("user", "presence_penalty", "frequency_penalty", "logit_bias"):
        value = {"user": "me", "logit_bias": {}}.get(field, 0.0)
        body = {"prompt": "w1", "max_tokens": 1, field: value}
        assert httpx.post(f"{server}/v1/completions", json=body).status_code == 200


def test_routes_methods_and_the_openapi_document(server):
    not_allowed = httpx.get(f"{server}/v1/completions")
    assert not_allowed.status_code == 405 and not_allowed.headers["allow"] == "POST"
    assert httpx.get(f"{server}/v1/models/{MODEL}").json()["id"] == MODEL
    assert httpx.get(f"{server}/v1/models/other").status_code == 404
    document = httpx.get(f"{server}/openapi.json").json()
    completions = document["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "500"} <= set(completions) and "422" not in completions
    assert "text/event-stream" in completions["200"]["content"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain; version=0.0.4; charset=utf-8"]


def test_python_dash_m_is_the_mlafx_command():
    done = subprocess.run(
        [sys.executable, "-m", "mlafx", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "chat" in done.stdout and "serve" in done.stdout


EXTREMES = [{"temperature": 1e-39}, {"temperature": 1.0, "top_p": 5e-324}]


def test_extreme_values_next_to_running_streams(server, offline):
    """8 greedy streams run while the two extreme requests arrive: all finish right."""
    prompts = [[10 + 3 * i, 11 + 3 * i, 12 + 3 * i] for i in range(8)]
    want = [
        out.outputs[0].token_ids
        for out in offline.generate(prompts, mlafx.SamplingParams(max_tokens=24, ignore_eos=True))
    ]

    async def stream(http, prompt) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        ids = []
        async with http.stream(
            "POST", f"{server}/v1/completions", json={**body, "stream": True}
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    ids += event["choices"][0]["token_ids"]
        return ids

    async def extreme(http, params) -> dict:
        await asyncio.sleep(0.05)
        body = {"prompt": "w1 w2", "max_tokens": 4, "ignore_eos": True, **params}
        return (await http.post(f"{server}/v1/completions", json=body)).json()

    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(
                *(stream(http, p) for p in prompts), *(extreme(http, e) for e in EXTREMES)
            )

    results = asyncio.run(main())
    assert results[:8] == want
    greedy = offline_text(offline, "w1 w2", max_tokens=4)
    for response in results[8:]:
        assert response["choices"][0]["text"] == greedy  # both reduce to greedy decoding


def test_mlafx_chat_in_the_terminal(checkpoint, offline):
    """Two turns, a reset, a third turn: each reply is the engine's on the rendered history."""
    done = subprocess.run(
        [sys.executable, "-m", "mlafx", "chat", "--model", str(checkpoint), "--no-compile"]
        + ["--dtype", "float32", "--max-tokens", "4", "--temperature", "0"],
        input="w5 w6\nw7\n/reset\nw5 w6\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    replies = [line.removeprefix(">>> ") for line in done.stdout.splitlines()]
    replies = [r for r in replies if r and not r.startswith("(")]

    def reply(messages):
        text = offline.chat_template.render(messages)
        ids = offline.tokenizer.encode(text, add_special_tokens=False).ids
        return offline.generate([ids], mlafx.SamplingParams(max_tokens=4))[0].outputs[0].text

    first = reply([{"role": "user", "content": "w5 w6"}])
    history = [
        {"role": "user", "content": "w5 w6"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "w7"},
    ]
    assert replies == [first, reply(history), first]
    assert "(conversation reset)" in done.stdout
