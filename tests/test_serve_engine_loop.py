"""EngineLoop without HTTP: all-or-none submission, outputs routed to their submission, and
an engine failure dropping only the requests in flight (the loop keeps serving)."""

from __future__ import annotations

import asyncio

import pytest

import mlafx
from mlafx.serve.engine_loop import EngineError, EngineLoop
from tests.tiny_models import tiny_llm

GREEDY = mlafx.SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture
def loop():
    engine = EngineLoop(tiny_llm())
    engine.start()
    yield engine
    engine.stop()
    assert not engine.alive


async def drain(submission) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while not submission.finished:
        index, output = await submission.next()
        tokens[index] = output.outputs[0].token_ids
    return tokens


def test_outputs_reach_their_own_submission(loop):
    async def main():
        first = await loop.submit([[5, 6, 7], [8, 9]], GREEDY)
        second = await loop.submit([[10, 11, 12, 13]], GREEDY)
        return await asyncio.gather(drain(first), drain(second))

    first, second = asyncio.run(main())
    # the same prompts offline, on the engine thread (the only one that may touch the LLM)
    expected = asyncio.run(
        loop.run(lambda llm: llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], GREEDY))
    )
    assert first == {0: expected[0].outputs[0].token_ids, 1: expected[1].outputs[0].token_ids}
    assert second == {0: expected[2].outputs[0].token_ids}


def test_a_bad_prompt_queues_none_of_the_request(loop):
    async def main():
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await loop.submit([[5, 6], [5, 9999]], GREEDY)
        return await loop.run(lambda llm: (llm.has_unfinished_requests(), llm.get_metrics()))

    unfinished, metrics = asyncio.run(main())
    assert not unfinished and metrics["num_aborted_requests"] == 1


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(loop):
    real_step = loop.llm.step
    calls = 0

    def failing_once():
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return real_step()

    loop.llm.step = failing_once

    async def main():
        doomed = await loop.submit([[5, 6, 7]], GREEDY)
        with pytest.raises(EngineError, match="boom"):
            await drain(doomed)
        fine = await loop.submit([[5, 6, 7]], GREEDY)
        return await drain(fine), await loop.run(lambda llm: llm.has_unfinished_requests())

    tokens, unfinished = asyncio.run(main())
    assert len(tokens[0]) == 3 and not unfinished
