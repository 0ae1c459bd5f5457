"""Partial-block prefix hits: the leading rows of a cached block (a full one, or a request's
partly filled last block) are copied into a new request's own block, so a prompt sent again
computes only its last token. Block manager and scheduler without a model, then the engine's
greedy tokens against each prompt served alone."""

from __future__ import annotations

from mlafx.runtime.block_hash import full_block_hashes
from mlafx.runtime.block_manager import BlockManager
from mlafx.runtime.metrics import EngineStats
from mlafx.runtime.request import Request
from mlafx.runtime.sampling_params import RequestMetrics, SamplingParams
from mlafx.runtime.scheduler import Scheduler
from tests.engine_compare import assert_same_greedy, greedy_params, random_prompts, reference_alone
from tests.tiny_models import tiny_llm

KEYS = full_block_hashes(list(range(8)), 4)


def test_lookup_rows_finds_the_longest_leading_run_after_its_parent():
    blocks = BlockManager(8)
    a, b, c = blocks.allocate(3)
    blocks.register_rows(a, KEYS[0], [1, 2, 3])
    blocks.register_rows(b, KEYS[0], [1, 2, 9, 9])
    blocks.register_rows(c, None, [1, 2, 3, 4])  # another parent: never a candidate
    assert blocks.lookup_rows(KEYS[0], [1, 2, 3, 5]) == (a, 3)
    assert blocks.lookup_rows(KEYS[0], [1, 2, 9]) == (b, 3)
    assert blocks.lookup_rows(KEYS[0], [1, 7]) in ((a, 1), (b, 1))
    assert blocks.lookup_rows(KEYS[0], [1, 7]) == (min(a, b), 1)  # ties: the lowest block id
    assert blocks.lookup_rows(KEYS[1], [1, 2]) == (0, 0)
    assert blocks.lookup_rows(KEYS[0], [5]) == (0, 0)
    # a holder computing more rows re-offers its block; rows held elsewhere are not doubled
    blocks.register_rows(a, KEYS[0], [1, 2, 3, 4])
    assert blocks.lookup_rows(KEYS[0], [1, 2, 3, 4]) == (a, 4)
    (d,) = blocks.allocate(1)
    blocks.register_rows(d, KEYS[0], [1, 2, 3])  # a's rows cover these
    blocks.free([a])
    assert blocks.lookup_rows(KEYS[0], [1, 2, 3]) == (a, 3)


def test_offered_rows_survive_their_holder_until_the_block_is_evicted():
    blocks = BlockManager(4)  # 3 usable
    a, plain = blocks.allocate(2)
    blocks.register_rows(a, None, [5, 6])
    blocks.free([a, plain])
    assert blocks.is_cached(a) and not blocks.is_registered(a)
    # uncached blocks are handed out first, as for full-block keys; then `a` is evicted
    assert sorted(blocks.allocate(2)) == sorted({1, 2, 3} - {a})
    assert blocks.lookup_rows(None, [5, 6]) == (a, 2)
    assert blocks.allocate(1) == [a] and blocks.lookup_rows(None, [5, 6]) == (0, 0)


def test_prefix_caching_off_offers_no_rows():
    blocks = BlockManager(4, enable_prefix_caching=False)
    (a,) = blocks.allocate(1)
    blocks.register_rows(a, None, [1, 2])
    assert blocks.lookup_rows(None, [1, 2]) == (0, 0)


def make_scheduler(copies: list, **kwargs) -> Scheduler:
    return Scheduler(
        BlockManager(32),
        EngineStats(),
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        copy_rows=lambda src, dst, rows: copies.append((src, dst, rows)),
        **kwargs,
    )


def request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), RequestMetrics(0.0))


def run(scheduler: Scheduler, req: Request) -> tuple[int, int]:
    """Admit ``req``, compute its prompt and one token; its first span."""
    scheduler.add(req)
    (seq,) = [s for s in scheduler.schedule() if s.request is req]
    req.num_computed_tokens = seq.end
    scheduler.register_computed_blocks(req)
    req.output_token_ids.append(100 + int(req.request_id))
    return seq.start, seq.end


def test_a_prompt_sent_again_copies_the_rows_of_its_last_block_and_computes_one_token():
    copies: list = []
    scheduler = make_scheduler(copies)
    first = request("1", list(range(10)))  # blocks of 4: 4 + 4 + 2 rows
    assert run(scheduler, first) == (0, 10)
    again = request("2", list(range(10)))
    assert run(scheduler, again) == (9, 10)
    assert again.blocks[:2] == first.blocks[:2] and again.blocks[2] != first.blocks[2]
    assert copies == [(first.blocks[2], again.blocks[2], 1)]  # row 8; row 9 is computed
    assert again.num_cached_tokens == 9 and scheduler.stats.prefix_cache_hit_tokens == 9
    # a block-aligned prompt: the last full block's leading rows
    shorter = request("3", list(range(8)))
    assert run(scheduler, shorter) == (7, 8)
    assert copies[-1] == (first.blocks[1], shorter.blocks[1], 3)
    # an output token's row exists once a decode step computed it; then a prompt
    # continuing the first's prompt and output hits through it
    follow = request("4", [*range(10), 101, 55])
    (decode,) = [s for s in scheduler.schedule() if s.request is first]
    assert (decode.start, decode.end) == (10, 11)
    first.num_computed_tokens = 11
    scheduler.register_computed_blocks(first)
    assert run(scheduler, follow) == (11, 12)
    assert copies[-1] == (first.blocks[2], follow.blocks[2], 3)


def test_no_partial_hits_without_copy_rows_or_after_an_external_load():
    scheduler = Scheduler(
        BlockManager(32), EngineStats(), block_size=4, max_num_seqs=8, max_num_batched_tokens=32
    )
    first = request("1", list(range(10)))
    assert run(scheduler, first) == (0, 10)
    assert run(scheduler, request("2", list(range(10)))) == (8, 10)


def test_the_engine_gives_the_tokens_of_each_prompt_alone():
    base = random_prompts(1, 70, 70, seed=11)[0]
    first = [base]
    later = [base, base[:37], base[:50] + [3, 4, 5], base + [9] * 5]
    refs = reference_alone(first + later, 6)
    llm = tiny_llm(block_size=16, num_kv_blocks=64)
    outputs = llm.generate(first, greedy_params(6))
    # the first prompt's output rows are cached too: a prompt continuing it hits them
    follow = base + outputs[0].outputs[0].token_ids[:3] + [7]
    refs += reference_alone([follow], 6)
    outputs += llm.generate(later, greedy_params(6))
    outputs += llm.generate([follow], greedy_params(6))
    assert_same_greedy(refs, outputs, "partial block hits")
    cached = [o.num_cached_tokens for o in outputs]
    assert cached == [0, 69, 36, 50, 70, len(follow) - 1]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks
