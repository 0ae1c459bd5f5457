"""Continuous batching, chunked prefill and preemption give the tokens of each prompt
served alone (fp32, tie-aware: ``tests/engine_compare.py``)."""

from __future__ import annotations

import pytest

import mlafx
from tests.engine_compare import (
    assert_same_greedy,
    greedy_params,
    random_prompts,
    reference_alone,
)
from tests.tiny_models import tiny_llm

NEW_TOKENS = 4


@pytest.fixture(scope="module")
def compiled_llm_factory():
    """Engines on the compiled step of one tiny config (fp32, block size 16), compiled once
    (cached in the repo's .cache/) and shared by the compiled tests of this module."""

    def make(**kwargs) -> mlafx.LLM:
        return tiny_llm(compile=True, block_size=16, **kwargs)

    return make


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_64_requests_together_equal_each_alone():
    prompts = random_prompts(64, 1, 600, seed=0)
    refs = reference_alone(prompts, NEW_TOKENS)
    llm = tiny_llm(block_size=16, num_kv_blocks=64 * 38 + 2)
    outputs = llm.generate(prompts, greedy_params(NEW_TOKENS))
    assert_same_greedy(refs, outputs, "64 together")
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] == 0 and metrics["num_finished_requests"] == 64
    # 2048-token budget, ~19k prompt tokens: prompts were split over steps
    assert metrics["num_steps"] > metrics["computed_prompt_tokens"] // 2048


def test_requests_together_equal_each_alone_compiled(compiled_llm_factory):
    prompts = random_prompts(12, 1, 300, seed=1)
    refs = reference_alone(prompts, NEW_TOKENS)
    llm = compiled_llm_factory(num_kv_blocks=12 * 20 + 2, max_num_batched_tokens=256)
    assert_same_greedy(refs, llm.generate(prompts, greedy_params(NEW_TOKENS)), "compiled")


@pytest.mark.parametrize(
    ("block_size", "compiled"),
    [(1, False), (16, False), (64, False), (16, True)],
    ids=["bs1", "bs16", "bs64", "bs16-compiled"],
)
def test_chunked_prefill_and_prefix_hits_give_the_unchunked_tokens(
    block_size, compiled, compiled_llm_factory
):
    shared = random_prompts(1, 150, 150, seed=2)[0]
    tails = random_prompts(3, 1, 40, seed=3)
    prompts = [*random_prompts(3, 1, 120, seed=4), shared + tails[0]]
    followers = [shared + t for t in tails[1:]] + [shared[:128]]  # the last: block-aligned
    refs = reference_alone(prompts + followers, NEW_TOKENS, block_size)
    options = dict(max_num_batched_tokens=32, num_kv_blocks=2048 // block_size + 8)
    llm = (
        compiled_llm_factory(**options) if compiled else tiny_llm(block_size=block_size, **options)
    )
    params = greedy_params(NEW_TOKENS)
    first = llm.generate(prompts, params)  # every prompt > 32 tokens is chunked
    assert llm.get_metrics()["num_steps"] >= sum(map(len, prompts)) // 32
    later = llm.generate(followers, params)  # prefix hits on the shared prompt's blocks
    assert_same_greedy(refs, first + later, f"bs {block_size}")
    # hits cover the longest prefix shared with the rows of an earlier request (its prompt
    # and every output token but the last, which was never fed back), whole blocks and then
    # a partial one, and never the last prompt token (it produces the logits)
    cached_rows = [o.prompt_token_ids + o.outputs[0].token_ids[:-1] for o in first + later]
    for i, out in enumerate(later):
        ids = out.prompt_token_ids
        shared_len = max(common_prefix(ids, rows) for rows in cached_rows[: len(first) + i])
        assert out.num_cached_tokens == min(shared_len, len(ids) - 1) >= 127
    assert llm.get_metrics()["prefix_cache_hit_tokens"] == sum(o.num_cached_tokens for o in later)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prompts"])
def test_a_cache_too_small_for_everyone_preempts_and_recomputes(chunked):
    prompts = random_prompts(6, 20, 40, seed=5)
    new_tokens = 24
    refs = reference_alone(prompts, new_tokens, block_size=4)
    # ~10 blocks per prompt at admission, up to 16 each by the end: 40 blocks hold 2-4
    llm = tiny_llm(block_size=4, num_kv_blocks=41, enable_chunked_prefill=chunked)
    outputs = llm.generate(prompts, greedy_params(new_tokens))
    assert_same_greedy(refs, outputs, "preempted")
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outputs) == metrics["num_preemptions"]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks


def test_sampled_requests_survive_preemption_unchanged():
    """A preempted request keeps its generator: seeded sampling continues where it was."""
    prompts = random_prompts(5, 20, 40, seed=6)
    params = mlafx.SamplingParams(max_tokens=20, temperature=1.0, seed=11, ignore_eos=True)
    roomy = tiny_llm(block_size=4, num_kv_blocks=200)
    tight = tiny_llm(block_size=4, num_kv_blocks=31)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert tight.get_metrics()["num_preemptions"] > 0


def test_incremental_api_streams_and_aborts():
    llm = tiny_llm(block_size=4, max_num_batched_tokens=16)
    params = greedy_params(6)
    a = llm.add_request([5, 6, 7, 8] * 10, params)
    b = llm.add_request([9, 10, 11], params)
    assert a != b and llm.has_unfinished_requests()
    seen: dict[str, list[int]] = {a: [], b: []}
    aborted = None
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens = out.outputs[0].token_ids
            assert tokens[: len(seen[out.request_id])] == seen[out.request_id]  # cumulative
            seen[out.request_id] = tokens
        if len(seen[b]) == 2 and aborted is None:
            aborted = llm.abort_request(b)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(seen[a]) == 6 and len(seen[b]) == 2
    assert llm.abort_request(b) is None and llm.abort_request("nope") is None
    assert llm.step() == []
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks
    # the first request's prompt (40 tokens) took 3 chunked steps before its first token
    assert llm.get_metrics()["num_aborted_requests"] == 1


def test_request_metrics_and_engine_metrics():
    llm = tiny_llm(block_size=4)
    prompt = list(range(2, 42))
    first, second = llm.generate([prompt, prompt], greedy_params(5))  # same step: no hit
    (third,) = llm.generate([prompt], greedy_params(5))  # a prefix hit
    for out in (first, second, third):
        m = out.metrics
        assert m.time_to_first_token > 0 and m.time_per_output_token > 0
        assert m.num_output_tokens == 5 and m.finished_time >= m.last_token_time
    assert third.num_cached_tokens == 39 and first.num_cached_tokens == 0  # all but the last
    metrics = llm.get_metrics()
    assert all(isinstance(v, int | float) for v in metrics.values())
    assert metrics["prompt_tokens"] == 120 and metrics["prefix_cache_hit_tokens"] == 39
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(39 / 120)
    assert metrics["external_hit_tokens"] == 0 and metrics["external_cache_hit_rate"] == 0
    assert metrics["computed_prompt_tokens"] == 120 - 39 and metrics["generation_tokens"] == 15
    assert metrics["prompt_tokens_per_s"] > 0 and metrics["generation_tokens_per_s"] > 0
    assert metrics["kv_cache_usage"] == 0


def test_prefix_caching_off_computes_everything():
    llm = tiny_llm(block_size=4, enable_prefix_caching=False)
    prompt = list(range(2, 42))
    a = llm.generate([prompt], greedy_params(3))[0]
    b = llm.generate([prompt], greedy_params(3))[0]
    assert b.num_cached_tokens == 0 and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert llm.get_metrics()["prefix_cache_hit_rate"] == 0
