"""The block manager and the scheduler without a model: ref counts, the prefix cache and
its LRU eviction, chunked prefill under the token budget, decodes first, preemption."""

from __future__ import annotations

import random

import pytest
from scheduler_traffic import finish_step, random_traffic, request

from mlafx.runtime.block_hash import full_block_hashes
from mlafx.runtime.block_manager import BlockManager, OutOfBlocksError
from mlafx.runtime.metrics import EngineStats
from mlafx.runtime.scheduler import ScheduledSequence, Scheduler

KEYS = full_block_hashes(list(range(40)), 4)  # 10 chained keys
OTHER = full_block_hashes([99] * 4, 4)[0]


def test_block_0_is_reserved_and_blocks_run_out():
    blocks = BlockManager(5)
    taken = blocks.allocate(4)
    assert sorted(taken) == [1, 2, 3, 4] and blocks.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError, match="asked for 1 KV blocks, 0 free"):
        blocks.allocate(1)
    blocks.free(taken)
    assert blocks.num_free_blocks == blocks.num_usable_blocks == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        blocks.free([taken[0]])
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1)


def test_lookup_touch_and_reference_counts():
    blocks = BlockManager(8)
    a = blocks.allocate(3)
    for block, key in zip(a, KEYS, strict=False):
        blocks.register(block, key)
    assert blocks.lookup(KEYS) == a  # a leading run: stops at the first unknown key
    assert blocks.lookup([KEYS[0], OTHER, KEYS[2]]) == a[:1]
    blocks.touch(a[:2])  # a second holder
    assert [blocks.ref_count(b) for b in a] == [2, 2, 1]
    blocks.free(a)
    assert blocks.num_free_blocks == 5  # a[2] is free but still cached
    assert blocks.lookup(KEYS) == a and blocks.num_free_among(a) == 1
    blocks.touch(a)  # takes a[2] back out of the free queue
    assert blocks.num_free_blocks == 4 and [blocks.ref_count(b) for b in a] == [2, 2, 1]
    # a second block computing a known key stays unregistered: the first keeps the key
    (other,) = blocks.allocate(1)
    blocks.register(other, KEYS[0])
    assert blocks.lookup(KEYS[:1]) == a[:1]


def test_lru_eviction_takes_plain_blocks_first_then_a_prefix_tail_first():
    blocks = BlockManager(7)  # 6 usable
    chain = blocks.allocate(3)
    for block, key in zip(chain, KEYS, strict=False):
        blocks.register(block, key)
    plain = blocks.allocate(3)
    blocks.free(chain)
    blocks.free(plain)
    assert blocks.num_cached_blocks == 3
    assert sorted(blocks.allocate(3)) == sorted(plain)  # uncached blocks go first
    assert blocks.lookup(KEYS) == chain
    assert blocks.allocate(1) == [chain[2]]  # then the tail of the prefix
    assert blocks.lookup(KEYS) == chain[:2] and blocks.num_cached_blocks == 2
    assert blocks.allocate(2) == [chain[1], chain[0]]
    assert blocks.lookup(KEYS) == [] and blocks.num_cached_blocks == 0


def test_prefix_caching_off_never_hits():
    blocks = BlockManager(4, enable_prefix_caching=False)
    (b,) = blocks.allocate(1)
    blocks.register(b, KEYS[0])
    assert blocks.lookup(KEYS) == [] and blocks.num_cached_blocks == 0


def make_scheduler(num_blocks=64, block_size=4, **kwargs) -> Scheduler:
    options = dict(max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True)
    options.update(kwargs)
    return Scheduler(BlockManager(num_blocks), EngineStats(), block_size=block_size, **options)


def spans(batch: list[ScheduledSequence]) -> dict[str, tuple[int, int]]:
    return {s.request.request_id: (s.start, s.end) for s in batch}


def test_chunked_prefill_splits_prompts_and_schedules_decodes_first():
    scheduler = make_scheduler()
    a, b = request("a", list(range(50))), request("b", list(range(100, 110)))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert spans(batch) == {"a": (0, 32)}  # the whole budget goes to a's first chunk
    finish_step(scheduler, batch)
    assert a.output_token_ids == []  # a chunk short of the prompt's end draws nothing
    batch = scheduler.schedule()
    assert spans(batch) == {"a": (32, 50), "b": (0, 10)}  # a's rest, then b (4 left over)
    finish_step(scheduler, batch)
    c = request("c", list(range(200, 260)))
    scheduler.add(c)
    batch = scheduler.schedule()
    assert spans(batch) == {"a": (50, 51), "b": (10, 11), "c": (0, 30)}
    assert list(spans(batch)) == ["a", "b", "c"]  # decodes first


def test_chunking_off_schedules_whole_prompts():
    scheduler = make_scheduler(enable_chunked_prefill=False)
    a, b = request("a", list(range(50))), request("b", list(range(100, 110)))
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    assert spans(batch) == {"a": (0, 50)}  # alone, a prompt may exceed the budget
    finish_step(scheduler, batch)
    assert spans(scheduler.schedule()) == {"a": (50, 51), "b": (0, 10)}


def test_max_num_seqs_bounds_the_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add(request(str(i), [i] * 3))
    assert set(spans(scheduler.schedule())) == {"0", "1"} and len(scheduler.waiting) == 1


def test_prefix_hits_are_whole_blocks_short_of_the_last_token():
    scheduler = make_scheduler()
    first = request("first", list(range(32)))
    scheduler.add(first)
    finish_step(scheduler, scheduler.schedule())
    assert first.num_registered_blocks == 8
    # block-aligned and identical: 7 blocks hit, the last token recomputed in a new block
    same = request("same", list(range(32)))
    scheduler.add(same)
    batch = scheduler.schedule()
    assert spans(batch)["same"] == (28, 32) and same.num_cached_tokens == 28
    assert same.blocks[:7] == first.blocks[:7] and same.blocks[7] != first.blocks[7]
    assert scheduler.blocks.ref_count(first.blocks[0]) == 2
    # a longer prompt sharing 30 tokens hits the 7 full blocks among them
    longer = request("longer", list(range(30)) + [99, 98, 97])
    scheduler.add(longer)
    assert spans(scheduler.schedule())["longer"] == (28, 33)
    assert scheduler.stats.prefix_cache_hit_tokens == 56


def test_preemption_evicts_the_latest_admitted_and_requeues_it_first():
    scheduler = make_scheduler(num_blocks=9, block_size=4)  # 8 usable blocks
    a, b = request("a", list(range(12)), 20), request("b", list(range(50, 62)), 20)
    scheduler.add(a)
    scheduler.add(b)
    finish_step(scheduler, scheduler.schedule())  # both prompts: 3 blocks each
    waiting = request("w", [1, 2, 3])
    scheduler.add(waiting)
    while not scheduler.stats.num_preemptions:
        batch = scheduler.schedule()
        finish_step(scheduler, batch)
    assert list(scheduler.waiting) == [b, waiting] and scheduler.running == [a]
    assert b.blocks == [] and b.num_computed_tokens == 0 and len(b.output_token_ids) > 1
    assert "w" not in spans(batch)  # nothing admitted in a step that preempted
    # b resumes once a has finished: it recomputes prompt + outputs in one span (its own
    # blocks are prefix hits while they stay cached) and goes on decoding
    generated = list(b.output_token_ids)
    while "b" not in spans(batch := scheduler.schedule()):
        finish_step(scheduler, batch)
    start, end = spans(batch)["b"]
    assert end == b.num_tokens and start % 4 == 0 and b.output_token_ids == generated
    assert scheduler.running[0] is b  # first in the queue, first admitted
    assert b.metrics.num_preemptions == 1 and b.num_cached_tokens == 0


@pytest.mark.parametrize(
    ("block_size", "num_blocks", "chunked"),
    [(1, 80, True), (4, 24, True), (4, 24, False), (16, 7, True)],
)
def test_random_traffic_keeps_the_cache_consistent(block_size, num_blocks, chunked):
    """A model-free engine loop over random requests sharing prefixes, with aborts: the
    "cache" records which token each row holds. Every span must find exactly its request's
    tokens in the rows it may read, write only blocks no one else holds and no cached
    block, stay within the budget, and every request must finish with all blocks freed."""
    rng = random.Random(block_size * 1000 + num_blocks + chunked)
    scheduler = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        enable_chunked_prefill=chunked,
    )
    blocks = scheduler.blocks
    rows: dict[tuple[int, int], int] = {}  # (block, offset) -> token id written there

    def check(batch: list[ScheduledSequence]) -> None:
        assert sum(s.num_tokens for s in batch) <= 24 or (not chunked and len(batch) == 1)
        assert len(scheduler.running) <= 6
        for seq in batch:
            r = seq.request
            assert seq.start == r.num_computed_tokens and len(r.blocks) * block_size >= seq.end
            for pos in range(seq.start):  # the context it reads holds its own tokens
                block = r.blocks[pos // block_size]
                assert rows[(block, pos % block_size)] == r.token_ids(pos, pos + 1)[0]
            for pos in range(seq.start, seq.end):  # the rows it writes are its own alone
                block = r.blocks[pos // block_size]
                assert blocks.ref_count(block) == 1 and not blocks.is_registered(block)
                rows[(block, pos % block_size)] = r.token_ids(pos, pos + 1)[0]

    random_traffic(scheduler, rng, check)
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert scheduler.stats.prefix_cache_hit_tokens > 0 and scheduler.stats.num_preemptions > 0
