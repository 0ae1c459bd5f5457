"""Token rows in blocks of their own, held only while a sequence still reads them.

DeepSeek-V4 caches two kinds of rows per layer (``models/deepseek_v4/step.py``): token rows
(the window's K=V rows and the compressors' inputs, thousands of values per token) and pool
entries (one per ``m`` tokens). A sequence reads a token row only while the row is inside its
window or its compressor window is still open, so past ``DeepseekV4Config.first_token_row_read``
its token rows are dead weight: kept, a V4-Flash token costs ~200 KB; dropped, ~7 KB.

So the engine keeps the token caches in ``num_blocks`` token blocks of their own, and this
allocator maps each cache block id (the block tables' ids, which the pools keep using) to the
token block holding that block's token rows, in ``table`` (``[num_cache_blocks]`` int32, 0 =
none: token block 0 is reserved, like cache block 0). The steps read token rows through it
(``V4StepInputs.bind_token_blocks``).

A cache block's token rows are *held* while some sequence still reads them (``hold``,
``allocate``, ``release``: counted per cache block). Released rows stay mapped, in a
least-recently-released queue, as the block manager keeps freed prefix blocks: a later prefix
hit that ends there can take them back (``has_rows``); only when a new block needs a token block
are the oldest released rows dropped (their cache block keeps its pool entries). Rows whose
cache block holds no reusable prefix (``is_cached`` False) are dropped first. When the block
manager hands a cache block out again, its old rows are forgotten (``forget``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.config.memory import dtype_bytes
from mlafx.runtime.options import DEFAULT_KV_CACHE_MEMORY, ServingOptions


class TokenRowBlocks:
    def __init__(
        self, num_blocks: int, num_cache_blocks: int, is_cached: Callable[[int], bool]
    ) -> None:
        """``num_blocks`` token blocks (block 0 reserved) for ``num_cache_blocks`` cache
        blocks; ``is_cached(block)``: whether a cache block holds rows a later request may
        reuse (``BlockManager.is_cached``)."""
        if num_blocks < 2:
            raise ValueError(f"token rows need at least 2 blocks (0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.table = torch.zeros(num_cache_blocks, dtype=torch.int32)
        self._token_block = [0] * num_cache_blocks  # ``table`` as a list, for the host's checks
        self._is_cached = is_cached
        self._holders = [0] * num_cache_blocks
        self._owner: dict[int, int] = {}  # token block -> the cache block whose rows it holds
        # token blocks nobody holds: unmapped or dropped-first ones at the front, then
        # released cached rows in release order (the oldest are taken first)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_available(self) -> int:
        """Token blocks a new block could take (unheld; some may hold released rows)."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def token_block(self, block: int) -> int:
        """The token block holding cache block ``block``'s rows (0: none kept)."""
        return self._token_block[block]

    def has_rows(self, block: int) -> bool:
        """Whether cache block ``block``'s token rows are still kept."""
        return self._token_block[block] != 0

    def num_available_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks``' kept rows sit unheld (holding them shrinks the pool)."""
        return sum(1 for b in blocks if self._holders[b] == 0 and self._token_block[b])

    def hold(self, blocks: Sequence[int]) -> None:
        """Take a hold on the kept token rows of ``blocks`` (a prefix hit's)."""
        for block in blocks:
            token_block = self._token_block[block]
            if not token_block:
                raise RuntimeError(f"cache block {block} keeps no token rows to hold")
            if self._holders[block] == 0:
                del self._free[token_block]
            self._holders[block] += 1

    def allocate(self, blocks: Sequence[int]) -> None:
        """Token blocks for fresh cache ``blocks`` (just allocated: no rows kept), dropping
        the oldest released rows if need be."""
        for block in blocks:
            if self._token_block[block] or self._holders[block]:
                raise RuntimeError(f"cache block {block} already has token rows")
        if len(blocks) > len(self._free):
            raise RuntimeError(f"asked for {len(blocks)} token blocks, {len(self._free)} free")
        for block in blocks:
            token_block, _ = self._free.popitem(last=False)
            previous = self._owner.pop(token_block, None)
            if previous is not None:
                self._map(previous, 0)
            self._owner[token_block] = block
            self._map(block, token_block)
            self._holders[block] = 1

    def replaces(self, holder: int, block: int) -> bool:
        """Whether ``block`` should take over the prefix key (or offered rows) of ``holder``
        (``BlockManager.replaces``): ``holder`` lost its token rows, ``block`` keeps its own.
        Else a prefix recomputed after its rows were dropped would never be reusable again."""
        return not self.has_rows(holder) and self.has_rows(block)

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one hold on the token rows of each of ``blocks`` (in position order: the
        earlier rows are dropped first, the last ones, which a hit on the whole sequence
        reads, last)."""
        for block in blocks:
            if self._holders[block] <= 0:
                raise RuntimeError(f"token rows of cache block {block} released more than held")
            self._holders[block] -= 1
            if self._holders[block] == 0:
                token_block = self._token_block[block]
                self._free[token_block] = None
                if not self._is_cached(block):  # no later request can want them
                    self._free.move_to_end(token_block, last=False)

    def forget(self, block: int) -> None:
        """Cache block ``block`` is handed out afresh: its old token rows are void."""
        token_block = self._token_block[block]
        if not token_block:
            return
        if self._holders[block]:
            raise RuntimeError(f"cache block {block} is reused while its token rows are held")
        del self._owner[token_block]
        self._map(block, 0)
        self._free.move_to_end(token_block, last=False)

    def _map(self, block: int, token_block: int) -> None:
        self.table[block] = token_block
        self._token_block[block] = token_block


def block_bytes(cfg: DeepseekV4Config, block_size: int, dtype: str) -> tuple[int, int]:
    """Bytes of one token block (every token cache's ``block_size`` rows) and of one cache
    block's pool entries (every pool cache's rows of a block)."""
    blocks = list(zip(cfg.cache_block_shapes(block_size), cfg.token_caches(), strict=True))
    tokens = sum(rows * width for (rows, width), token in blocks if token)
    pools = sum(rows * width for (rows, width), token in blocks if not token)
    return tokens * dtype_bytes(dtype), pools * dtype_bytes(dtype)


def cache_block_counts(
    cfg: DeepseekV4Config,
    options: ServingOptions,
    dtype: str,
    max_model_len: int,
    save_blocks: int = 0,
) -> tuple[int, int]:
    """(cache blocks, token blocks) of a V4 engine keeping token rows apart. The token blocks
    hold every running sequence's rows from its first read on (``max_num_seqs`` of them, and a
    step's new tokens; without chunked prefill, a whole ``max_model_len`` prompt) but take at
    most half of ``kv_cache_memory``, never fewer than one sequence's chunk of
    ``max_num_batched_tokens`` needs (without chunked prefill the engine refuses a request
    whose whole prompt would need more: ``token_blocks_for_lifetime``). The cache blocks (the
    pools, tiny per token) get the rest, at most as many as ``max_num_seqs`` sequences of
    ``max_model_len`` fill. With ``num_kv_blocks`` given, that many cache blocks and at most
    as many token blocks. ``save_blocks``: a KV connector's chunk, whose rows each sequence
    keeps until the chunk is saved."""
    bs = options.block_size
    token_bytes, pool_bytes = block_bytes(cfg, bs, dtype)
    lookback = -(-cfg.token_row_lookback // bs)
    chunk = options.max_num_batched_tokens
    least = -(-(chunk + cfg.token_row_lookback) // bs) + 3 + save_blocks  # + reserved block 0
    wanted = options.max_num_seqs * (lookback + 2 + save_blocks) + -(-chunk // bs) + 1
    if not options.enable_chunked_prefill:  # a whole prompt (or a recompute) is one step
        wanted = max(wanted, -(-max_model_len // bs) + 2)
    if options.num_kv_blocks is not None:
        blocks = options.num_blocks(cfg, dtype)
        return blocks, min(blocks, max(least, wanted))
    memory = DEFAULT_KV_CACHE_MEMORY if options.kv_cache_memory is None else options.kv_cache_memory
    tokens = max(least, min(wanted, memory // 2 // token_bytes))
    blocks = (memory - tokens * token_bytes) // max(pool_bytes, 1)
    # a model without pools: as many block ids as every sequence could fill
    blocks = min(blocks, options.max_num_seqs * -(-max_model_len // bs) + 1)
    if blocks < 2:
        raise ValueError(
            f"a kv_cache_memory of {memory / 2**20:.1f} MiB holds {blocks} KV block(s) after the "
            f"{tokens} token-row blocks of {bs} tokens one step may need "
            f"({tokens * token_bytes / 2**20:.1f} MiB); at least 2 are needed: raise it"
        )
    return int(blocks), int(min(tokens, blocks))


def token_blocks_for_lifetime(cache_blocks: int) -> int:
    """Token blocks a request computing all its ``cache_blocks`` in one step holds at once
    (prefill or recompute without chunking: its rows from position 0, and a partial hit's
    source block while its rows are copied)."""
    return cache_blocks + 1


def keeps_token_rows_apart(config: object, step_fn: object, kv_connector: object) -> bool:
    """Whether an engine keeps token rows in blocks of their own: a DeepSeek-V4 model whose
    step reads them through a token-block map (``bind_token_blocks``), without a KV connector
    or with one that takes a block-id list per cache (``KVConnector.supports_token_rows``)."""
    return (
        isinstance(config, DeepseekV4Config)
        and hasattr(step_fn, "bind_token_blocks")
        and (kv_connector is None or bool(getattr(kv_connector, "supports_token_rows", False)))
    )
