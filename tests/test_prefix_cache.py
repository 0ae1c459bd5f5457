"""Prefix reuse in the engine: local prefix-cache hits shared by running requests, hits
surviving LRU eviction pressure, and an in-memory KV connector shared by two engines."""

from __future__ import annotations

import pytest

from mlafx.config import ModelConfig
from mlafx.runtime.block_hash import cache_fingerprint
from mlafx.runtime.kv_connector.base import KVConnector
from tests.engine_compare import assert_same_greedy, greedy_params, random_prompts, reference_alone
from tests.memory_connector import InMemoryConnector
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

NEW_TOKENS = 4
BLOCK = 16
# what tiny_llm's engines at BLOCK compute their connector's namespace from
FINGERPRINT = cache_fingerprint(
    ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES), "float32", BLOCK
)


def engine(connector: KVConnector | None = None, **kwargs):
    return tiny_llm(block_size=BLOCK, num_kv_blocks=128, kv_connector=connector, **kwargs)


@pytest.fixture(scope="module")
def long_prompt():
    prompt = random_prompts(1, 300, 300, seed=7)[0]
    return prompt, reference_alone([prompt], NEW_TOKENS)


def test_a_second_engine_loads_the_prefix_from_the_connector(long_prompt):
    prompt, refs = long_prompt
    store = InMemoryConnector(FINGERPRINT, BLOCK)
    first = engine(store)
    assert first.cache_fingerprint == FINGERPRINT
    cold = first.generate([prompt], greedy_params(NEW_TOKENS))
    assert store.saves == 1 and len(store.blocks) == 300 // BLOCK
    second = engine(store)  # a fresh cache: nothing local
    warm = second.generate([prompt], greedy_params(NEW_TOKENS))
    assert_same_greedy(refs * 2, cold + warm, "connector")
    hit = (300 - 1) // BLOCK * BLOCK  # every full block short of the last token
    assert warm[0].num_cached_tokens == hit
    metrics = second.get_metrics()
    assert metrics["external_hit_tokens"] == hit and metrics["prefix_cache_hit_tokens"] == 0
    assert metrics["external_cache_hit_rate"] == pytest.approx(hit / 300)
    assert metrics["computed_prompt_tokens"] == 300 - hit
    # loaded blocks join the local prefix cache: a third request hits locally, and the
    # rows the second computed in its last block are a partial hit: all but the last token
    (again,) = second.generate([prompt], greedy_params(NEW_TOKENS))
    assert again.num_cached_tokens == 300 - 1
    assert second.get_metrics()["external_hit_tokens"] == hit  # the store was not asked


def test_a_partial_load_computes_the_rest(long_prompt):
    prompt, refs = long_prompt
    store = InMemoryConnector(FINGERPRINT, BLOCK)
    engine(store).generate([prompt], greedy_params(NEW_TOKENS))
    store.drop_after = 5  # the 6th block is "corrupt": a miss from there on
    second = engine(store, max_num_batched_tokens=64)
    out = second.generate([prompt], greedy_params(NEW_TOKENS))
    assert_same_greedy(refs, out, "partial load")
    assert out[0].num_cached_tokens == 5 * BLOCK
    assert second.get_metrics()["external_hit_tokens"] == 5 * BLOCK
    assert second.block_manager.num_free_blocks == second.block_manager.num_usable_blocks


def test_local_hits_come_before_the_connector(long_prompt):
    prompt, _ = long_prompt
    store = InMemoryConnector(FINGERPRINT, BLOCK)
    engine(store).generate([prompt], greedy_params(NEW_TOKENS))
    llm = engine(store)
    llm.generate([prompt[:100]], greedy_params(NEW_TOKENS))  # 96 tokens: external
    (out,) = llm.generate([prompt], greedy_params(NEW_TOKENS))
    metrics = llm.get_metrics()
    assert out.num_cached_tokens == 288
    assert metrics["prefix_cache_hit_tokens"] == 96 and metrics["external_hit_tokens"] == 96 + 192


def test_a_connector_for_another_cache_is_refused():
    with pytest.raises(ValueError, match="made for block size 4"):
        engine(InMemoryConnector(FINGERPRINT, 4))
    with pytest.raises(ValueError, match="cache fingerprint"):
        engine(InMemoryConnector("0" * 64, BLOCK))
    with pytest.raises(TypeError, match="spec string or a KVConnector"):
        engine(42)


def test_running_requests_share_blocks_and_never_write_them():
    prompts = random_prompts(1, 100, 100, seed=8)
    prompts += [prompts[0] + [5, 6], prompts[0][:64], prompts[0]]
    refs = reference_alone(prompts, 8)
    llm = engine()
    outputs = llm.generate(prompts[:1], greedy_params(8))
    # three requests hit the same cached blocks at once, and decode side by side
    outputs += llm.generate(prompts[1:], greedy_params(8))
    assert_same_greedy(refs, outputs, "shared")
    # whole blocks, then the leading rows of the next cached block (copied, not shared):
    # the first prompt's 100 rows; 63 of 64; 99 of 100
    assert [o.num_cached_tokens for o in outputs] == [0, 100, 63, 99]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks


def test_hits_under_eviction_pressure_stay_correct():
    """A cache that cannot keep every prefix: old blocks are evicted (LRU), hits shrink or
    vanish, tokens never change."""
    prompts = random_prompts(6, 60, 90, seed=9)
    refs = reference_alone(prompts, NEW_TOKENS)
    llm = tiny_llm(block_size=BLOCK, num_kv_blocks=14)  # 13 blocks: about two prompts
    outputs = [llm.generate([p], greedy_params(NEW_TOKENS))[0] for p in prompts]
    outputs += [llm.generate([p], greedy_params(NEW_TOKENS))[0] for p in reversed(prompts)]
    assert_same_greedy(refs + refs[::-1], outputs, "eviction")
    cached = [o.num_cached_tokens for o in outputs[len(prompts) :]]
    assert cached[0] > 0  # the last prompt served is still cached
    assert cached[-1] == 0  # the first one was evicted long ago
