"""``LLM(batch_invariant=True)`` (issue 27): a request's tokens and logprobs are bitwise the
same served alone, inside batches of 2-32 random others at any position, with its prompt
chunked or whole, with its prefix from the cache, and from a KV store, in bf16 and fp32 on the
compiled step, under tensor parallelism, with int8/int4 weights and block-FP8 checkpoints.
Prompts up to 700 tokens
cross the attention kernel's fixed split size (512 keys) and the linears' streaming limit;
batches put hundreds of (token, choice) pairs on each expert."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import mlafx
from tests.engine_compare import random_prompts
from tests.test_block_fp8_checkpoint import MODELS as FP8_MODELS
from tests.test_block_fp8_checkpoint import write_fp8_checkpoint_of
from tests.tiny_models import tiny_llm

PARAMS = mlafx.SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)
TARGETS = random_prompts(3, 5, 700, seed=10) + [random_prompts(1, 600, 700, seed=11)[0]]


def invariant_llm(dtype: str, **options) -> mlafx.LLM:
    return tiny_llm(
        compile=True, dtype=dtype, block_size=16, num_kv_blocks=2048, batch_invariant=True,
        **options,
    )  # fmt: skip


def results(outputs: list[mlafx.RequestOutput]) -> list[tuple]:
    """What must be bitwise equal: tokens and every top-k logprob of every step."""
    return [
        (
            tuple(o.outputs[0].token_ids),
            tuple(tuple(sorted(d.items())) for d in o.outputs[0].logprobs),
        )
        for o in outputs
    ]


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def alone(request):
    """(dtype, each target served alone: whole prompt, no prefix cache)."""
    llm = invariant_llm(request.param, enable_prefix_caching=False, enable_chunked_prefill=False)
    return request.param, [results(llm.generate([p], PARAMS))[0] for p in TARGETS]


def test_inside_random_batches(alone):
    dtype, expected = alone
    llm = invariant_llm(dtype, enable_prefix_caching=False, enable_chunked_prefill=False)
    rng = random.Random(0)
    for trial, size in enumerate([2, 9, 32]):
        others = random_prompts(size - 1, 1, 300, seed=100 + trial)
        i = rng.randrange(len(TARGETS))
        at = rng.randrange(size)
        got = results(llm.generate(others[:at] + [TARGETS[i]] + others[at:], PARAMS))[at]
        assert got == expected[i], (dtype, size, at)


def test_chunked_and_from_the_prefix_cache(alone):
    dtype, expected = alone
    llm = invariant_llm(dtype, max_num_batched_tokens=48)  # every long prompt chunked
    others = random_prompts(5, 1, 200, seed=7)
    assert results(llm.generate(TARGETS + others, PARAMS))[: len(TARGETS)] == expected
    again = llm.generate(TARGETS, PARAMS)  # whole blocks (and leading rows) from the cache
    assert all(o.num_cached_tokens > 0 for o in again if len(o.prompt_token_ids) > 16)
    assert results(again) == expected


def test_from_a_kv_store(alone, tmp_path):
    dtype, expected = alone
    store = f"disk:{tmp_path / 'kv'}"
    writer = invariant_llm(dtype, kv_connector=store, enable_prefix_caching=False)
    assert results(writer.generate(TARGETS, PARAMS)) == expected
    reader = invariant_llm(dtype, kv_connector=store, enable_prefix_caching=False)
    loaded = reader.generate(TARGETS, PARAMS)
    assert any(o.num_cached_tokens > 0 for o in loaded)
    assert results(loaded) == expected


def test_tensor_parallel_ranks_are_invariant_too():
    """TP=2 (fp32): each rank runs its steps in the driver's mode; a target alone, chunked at
    one set of boundaries, equals it inside a batch, chunked at others."""
    llm = tiny_llm(
        tensor_parallel_size=2, compile=True, block_size=16, num_kv_blocks=1024,
        max_num_batched_tokens=48, batch_invariant=True,
    )  # fmt: skip
    try:
        alone = [results(llm.generate([p], PARAMS))[0] for p in TARGETS[:2]]
        others = random_prompts(8, 1, 200, seed=5)
        batch = results(llm.generate(others[:3] + TARGETS[:2] + others[3:], PARAMS))
        assert batch[3:5] == alone
    finally:
        llm.close()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_on_load_is_invariant_too(quantization):
    """int8/int4 weights (fp32 activations, where a sum's order would show): each target
    alone, chunked at one set of boundaries, equals it inside a batch, chunked at others and
    partly from the prefix cache."""
    llm = invariant_llm("float32", quantization=quantization, max_num_batched_tokens=48)
    alone = [results(llm.generate([p], PARAMS))[0] for p in TARGETS[:2]]
    llm = invariant_llm("float32", quantization=quantization, max_num_batched_tokens=48)
    others = random_prompts(8, 1, 200, seed=6)
    batch = llm.generate(others[:3] + TARGETS[:2] + others[3:], PARAMS)
    assert results(batch)[3:5] == alone
    again = llm.generate(others[:1] + TARGETS[:2], PARAMS)
    assert all(o.num_cached_tokens > 0 for o in again[1:])
    assert results(again)[1:] == alone


def assert_stored_checkpoint_is_invariant(
    path: Path,
    targets: list[list[int]],
    others: list[list[int]],
    max_num_batched_tokens: int,
    params: mlafx.SamplingParams = PARAMS,
) -> None:
    """The checkpoint at ``path`` served in fp32 with ``batch_invariant=True`` (fp32: where a
    sum's order would show): each of the two targets alone equals it inside a batch of
    ``others``, chunked every ``max_num_batched_tokens``, and again partly from the prefix
    cache."""

    def llm(**options) -> mlafx.LLM:
        return mlafx.LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=1024,
                         batch_invariant=True, progress=False, **options)  # fmt: skip

    single = llm(enable_prefix_caching=False, enable_chunked_prefill=False)
    alone = [results(single.generate([p], params))[0] for p in targets]
    batched = llm(max_num_batched_tokens=max_num_batched_tokens)
    assert results(batched.generate(others[:2] + targets + others[2:], params))[2:4] == alone
    again = batched.generate(others[:1] + targets, params)
    assert all(o.num_cached_tokens > 0 for o in again[1:])
    assert results(again)[1:] == alone


def test_block_fp8_checkpoints_are_invariant_too(tmp_path):
    """A DeepSeek-layout FP8 checkpoint with partial blocks, fp32 activations (bf16 outputs hide
    a sum's order in a model this small, so the bf16 kernels' rows are checked in
    tests/test_batch_invariant_kernels.py)."""
    overrides, block = FP8_MODELS["v3_blocks_16x32"]
    write_fp8_checkpoint_of(tmp_path, overrides, block)
    rng = random.Random(4)  # the tiny checkpoints have 160 tokens and 256 positions
    targets = [[rng.randrange(2, 160) for _ in range(n)] for n in (7, 150)]
    others = [[rng.randrange(2, 160) for _ in range(n)] for n in (90, 3, 200, 41, 120)]
    assert_stored_checkpoint_is_invariant(tmp_path, targets, others, max_num_batched_tokens=24)


def test_the_reference_model_is_refused():
    with pytest.raises(ValueError, match="needs compile=True"):
        tiny_llm(batch_invariant=True, compile=False)
