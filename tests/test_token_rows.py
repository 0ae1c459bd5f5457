"""DeepSeek-V4's token rows in blocks of their own (``runtime/token_rows.py``), without a model:
the bound ``first_token_row_read`` against what V4's steps read, the token-block allocator, and
the scheduler holding a request's token rows only from that bound on."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_traffic import finish_step, random_traffic, request
from transformers import DeepseekV4Config as HFConfig
from v4_cases import TINY_V4

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.step import SequenceStep, v4_step_metadata
from mlafx.runtime.block_manager import BlockManager
from mlafx.runtime.metrics import EngineStats
from mlafx.runtime.options import ServingOptions
from mlafx.runtime.request import Request
from mlafx.runtime.scheduler import ScheduledSequence, Scheduler
from mlafx.runtime.token_rows import TokenRowBlocks, cache_block_counts


def _config(**overrides) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf_dict(HFConfig(**{**TINY_V4, **overrides}).to_dict())


CONFIGS = {
    "tiny": _config(),  # window 8, CSA 4 (overlapping), HCA 16
    "wide_window": _config(sliding_window=40),
    "sliding_and_hca": _config(
        layer_types=["sliding_attention", "heavily_compressed_attention"] * 2
    ),
    # CSA's two windows reach further back than a window of 3
    "csa_past_the_window": _config(
        sliding_window=3, layer_types=["sliding_attention", "compressed_sparse_attention"] * 2
    ),
}


def _positions_read(cfg: DeepseekV4Config, context: int, new: int, block_size: int) -> set[int]:
    """Every token position whose rows the dense step metadata of one sequence names (its
    window keys, its closing entries' sources), block ``i`` of the sequence being block
    ``i + 1``."""
    blocks = list(range(1, -(-(context + new) // block_size) + 1))
    meta = v4_step_metadata(
        [SequenceStep(context, new, blocks)], block_size, cfg.sliding_window,
        cfg.compress_rates, overlapping_rates=cfg.overlapping_rates,
    )  # fmt: skip
    slots = meta.key_slots.tolist()
    for pool in meta.pools:
        rows = pool.close_sources
        m = pool.rate
        # a non-overlapping rate's first m sources repeat its own window: unread
        slots += (rows if m in cfg.overlapping_rates else rows[:, m:]).flatten().tolist()
    return {slot - block_size for slot in slots}


@pytest.mark.parametrize("name", CONFIGS)
def test_first_read_is_exactly_where_later_decode_steps_stop_reading(name):
    """Decoding token by token, the rows a step at position p or any later one reads start
    exactly at ``first_token_row_read(p)``: nothing after it may be dropped, everything before
    it is dead. The bound never decreases and never passes p."""
    cfg = CONFIGS[name]
    reads = [min(_positions_read(cfg, p, 1, 8)) for p in range(200)]
    for p in range(200 - 2 * max(cfg.compress_rates) - cfg.sliding_window):
        assert min(reads[p:]) == cfg.first_token_row_read(p), p
        assert cfg.first_token_row_read(p) <= cfg.first_token_row_read(p + 1) <= p + 1
        assert p - cfg.first_token_row_read(p) <= cfg.token_row_lookback
    assert max(p - cfg.first_token_row_read(p) for p in range(200)) == cfg.token_row_lookback


@settings(max_examples=12, deadline=None)
@given(
    window=st.integers(1, 48),
    csa=st.sampled_from([2, 4, 8]),
    hca=st.sampled_from([8, 16, 32]),
    kinds=st.sampled_from(["csa", "hca", "both"]),
    steps=st.lists(st.tuples(st.integers(0, 150), st.integers(1, 40)), min_size=5, max_size=5),
)
def test_first_read_holds_for_any_window_and_rates(window, csa, hca, kinds, steps):
    """Any window and rates: decode steps from p on read exactly from
    ``first_token_row_read(p)``, and a step of any span reads nothing before it."""
    layer = {"csa": ["compressed_sparse_attention"], "hca": ["heavily_compressed_attention"]}
    compressed = layer["csa"] + layer["hca"] if kinds == "both" else layer[kinds]
    cfg = _config(
        sliding_window=window,
        num_hidden_layers=1 + len(compressed),
        layer_types=["sliding_attention", *compressed],
        mlp_layer_types=["hash_moe", *["moe"] * len(compressed)],
        compress_rates={"compressed_sparse_attention": csa, "heavily_compressed_attention": hca},
    )
    horizon = 2 * max(cfg.compress_rates) + window
    reads = [min(_positions_read(cfg, p, 1, 8)) for p in range(120 + horizon)]
    for p in range(120):
        assert min(reads[p:]) == cfg.first_token_row_read(p), p
    for context, new in steps:
        assert min(_positions_read(cfg, context, new, 8)) >= cfg.first_token_row_read(context)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_a_step_names_no_token_block_before_its_first_read(name, block_size):
    """Steps of any span after any context, dense and sparse, build with every token block
    before ``first_token_row_read(context)`` absent (0: naming one raises), and their windows
    select no position before it."""
    cfg = CONFIGS[name]
    rng = random.Random(block_size)
    for _ in range(60):
        context, new = rng.randrange(300), rng.randint(1, 40)
        count = -(-(context + new) // block_size)
        blocks = list(range(1, count + 1))
        first = cfg.first_token_row_read(context) // block_size
        tokens = [0] * first + [b + 100 for b in blocks[first:]]
        seq = SequenceStep(context, new, blocks, tokens)
        for sparse in (False, True):
            meta = v4_step_metadata(
                [seq], block_size, cfg.sliding_window, cfg.compress_rates, sparse=sparse,
                overlapping_rates=cfg.overlapping_rates,
            )  # fmt: skip
            if sparse:
                window = meta.sparse.window
                assert int(window[window >= 0].min()) >= cfg.first_token_row_read(context)
                assert meta.sparse.block_table[0].tolist() == tokens
        if first:
            zeroed = [0] * (first + 1) + tokens[first + 1 :]
            if cfg.first_token_row_read(context) % block_size == 0 and first < count:
                with pytest.raises(ValueError, match="no token rows there"):
                    v4_step_metadata(
                        [SequenceStep(context, new, blocks, zeroed)], block_size,
                        cfg.sliding_window, cfg.compress_rates,
                        overlapping_rates=cfg.overlapping_rates,
                    )  # fmt: skip


def test_token_blocks_are_held_released_kept_and_dropped_oldest_first():
    cached: set[int] = set()
    rows = TokenRowBlocks(4, 10, cached.__contains__)  # 3 usable token blocks
    rows.allocate([5, 6, 7])
    assert rows.num_available == 0 and rows.num_held == 3
    assert sorted(rows.table[[5, 6, 7]].tolist()) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="asked for 1 token blocks, 0 free"):
        rows.allocate([8])
    with pytest.raises(RuntimeError, match="already has token rows"):
        rows.allocate([6])
    cached.update({5, 6})
    rows.release([6])  # cached: kept for a later hit
    rows.release([7])  # not cached: its token block is the first to go
    assert rows.num_available == 2
    rows.allocate([8])
    assert not rows.has_rows(7) and rows.has_rows(8) and rows.has_rows(6)
    rows.release([5])
    rows.allocate([9])  # then the oldest released rows: 6's, released before 5's
    assert not rows.has_rows(6) and rows.has_rows(5)
    assert rows.num_available_among([5, 6, 8]) == 1  # 5 sits unheld, 6 is gone, 8 is held
    rows.hold([5])  # a prefix hit takes 5's rows back
    assert rows.num_available == 0 and rows.num_held == 3
    with pytest.raises(RuntimeError, match="keeps no token rows"):
        rows.hold([6])
    with pytest.raises(RuntimeError, match="reused while its token rows are held"):
        rows.forget(5)
    rows.release([5, 8, 9])
    rows.forget(5)  # the block manager hands cache block 5 out afresh
    assert not rows.has_rows(5) and rows.num_available == 3 and rows.num_held == 0
    with pytest.raises(RuntimeError, match="released more than held"):
        rows.release([8])


def test_cache_block_counts_split_the_memory_between_token_rows_and_pools():
    """Token blocks for every running sequence's rows from its first read on, within half the
    memory but never fewer than one step needs; the pools get the rest."""
    cfg = CONFIGS["tiny"]  # reads up to 15 tokens back: 2 blocks of 8
    kinds = zip(cfg.cache_block_shapes(8), cfg.token_caches(), strict=True)
    token_bytes = 8 * sum(w for (_, w), token in kinds if token) * 4
    limits = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64)
    wanted = 4 * (2 + 2) + 64 // 8 + 1  # 4 sequences (2 blocks back, 2 ahead), a step's tokens
    least = -(-(64 + 15) // 8) + 3  # one sequence's longest step, and block 0
    cases = {  # kv_cache_memory -> token blocks
        None: wanted,  # 1 GiB
        2 * 20 * token_bytes: 20,  # half the memory
        2 * 10 * token_bytes: least,
    }
    for memory, tokens in cases.items():
        options = ServingOptions(**limits, kv_cache_memory=memory)
        blocks, got = cache_block_counts(cfg, options, "float32", 512)
        assert got == tokens, memory
        assert blocks <= 4 * 512 // 8 + 1  # what 4 sequences of 512 tokens fill at most
    # without chunked prefill a whole prompt is one step: as many as half the memory holds
    whole = dict(limits, enable_chunked_prefill=False, kv_cache_memory=2 * 20 * token_bytes)
    assert cache_block_counts(cfg, ServingOptions(**whole), "float32", 131072)[1] == 20
    given = ServingOptions(block_size=8, num_kv_blocks=12)
    assert cache_block_counts(cfg, given, "float32", 512) == (12, 12)
    tight = ServingOptions(block_size=8, kv_cache_memory=1 << 20)  # steps of 2048 tokens
    with pytest.raises(ValueError, match="raise it"):
        cache_block_counts(cfg, tight, "float32", 512)


def _serve(scheduler: Scheduler, request: Request) -> int:
    """Run ``request`` alone to its end (the engine's bookkeeping, no model); its hit tokens."""
    scheduler.add(request)
    before = scheduler.stats.prefix_cache_hit_tokens
    while scheduler.has_unfinished():
        finish_step(scheduler, scheduler.schedule())
    return scheduler.stats.prefix_cache_hit_tokens - before


def test_a_prefix_recomputed_after_its_rows_were_dropped_is_reusable_again():
    """A's prompt is cached, then other traffic takes every token block: B, with the same
    prompt, finds the blocks but not the token rows its next step reads, so it reuses none
    and recomputes them; B's blocks, which keep their rows, take the keys over from A's, so C
    hits again (and its last step's rows are the ones kept longest)."""
    cfg = CONFIGS["tiny"]
    blocks = BlockManager(64)
    token_rows = TokenRowBlocks(12, 64, blocks.is_cached)
    blocks.on_reuse, blocks.replaces = token_rows.forget, token_rows.replaces
    scheduler = Scheduler(
        blocks, EngineStats(), block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
        copy_rows=lambda src, dst, rows: None, token_rows=token_rows,
        first_read=cfg.first_token_row_read,
    )  # fmt: skip
    prompt = list(range(33))
    assert _serve(scheduler, request("a", prompt, 2)) == 0
    assert _serve(scheduler, request("a again", prompt, 2)) == 32  # rows still kept
    assert _serve(scheduler, request("other", list(range(50, 100)), 2)) == 0
    assert _serve(scheduler, request("b", prompt, 2)) == 0  # A's rows are gone
    assert _serve(scheduler, request("c", prompt, 2)) == 32


@pytest.mark.parametrize(("block_size", "num_token_blocks"), [(4, 16), (8, 9), (16, 6)])
def test_random_traffic_reads_only_held_token_rows_of_its_own(block_size, num_token_blocks):
    """A model-free engine loop over random requests sharing prefixes, with aborts, the token
    rows in few blocks of their own: every span finds its own tokens in the token rows from
    its first read on and in the pool rows of every block before, writes only rows no one
    else holds, holds no token rows before its first read, and every block and token block is
    free at the end. Hits and preemptions both happen."""
    cfg = CONFIGS["tiny"]
    rng = random.Random(block_size * 100 + num_token_blocks)
    blocks = BlockManager(40)
    token_rows = TokenRowBlocks(num_token_blocks, 40, blocks.is_cached)
    blocks.on_reuse, blocks.replaces = token_rows.forget, token_rows.replaces
    scheduler = Scheduler(
        blocks, EngineStats(), block_size=block_size, max_num_seqs=4, max_num_batched_tokens=12,
        token_rows=token_rows, first_read=cfg.first_token_row_read,
    )  # fmt: skip
    pool_rows: dict[tuple[int, int], int] = {}  # (block, offset) -> token id written there
    token_cache: dict[tuple[int, int], int] = {}  # (token block, offset) -> token id

    def check(batch: list[ScheduledSequence]) -> None:
        for seq in batch:
            r = seq.request
            assert r.token_rows_from == cfg.first_token_row_read(seq.start) // block_size
            assert all(token_rows.has_rows(b) for b in r.blocks[r.token_rows_from :])
            for pos in range(seq.start):
                b, off = r.blocks[pos // block_size], pos % block_size
                want = r.token_ids(pos, pos + 1)[0]
                assert pool_rows[(b, off)] == want
                if pos >= cfg.first_token_row_read(seq.start):
                    assert token_cache[(token_rows.token_block(b), off)] == want
            for pos in range(seq.start, seq.end):
                b, off = r.blocks[pos // block_size], pos % block_size
                assert blocks.ref_count(b) == 1 and not blocks.is_registered(b)
                want = r.token_ids(pos, pos + 1)[0]
                pool_rows[(b, off)] = token_cache[(token_rows.token_block(b), off)] = want

    random_traffic(
        scheduler, rng, check, stem_len=40, extra=10, arrive=0.25, abort=0.02, steps=4000
    )
    assert blocks.num_free_blocks == blocks.num_usable_blocks and token_rows.num_held == 0
    assert scheduler.stats.prefix_cache_hit_tokens > 0 and scheduler.stats.num_preemptions > 0
