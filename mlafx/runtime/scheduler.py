"""Decides which tokens each step computes (continuous batching, vLLM-style).

Per step, within ``max_num_batched_tokens`` new tokens and ``max_num_seqs`` running
requests:
1. running requests, decodes first, then unfinished prompts (their next chunk);
2. waiting requests, first come first served: a prefix-cache lookup, then the KV
   connector for further leading blocks, then the first chunk of what is left.
With ``enable_chunked_prefill`` a prompt longer than the budget left is split across
steps; without it a prompt is scheduled whole (alone in a step it may exceed the budget).

Blocks are allocated as tokens need them. When a running request needs a block and none is
free, the most recently admitted running request is preempted by recompute: its blocks are
freed and it goes back to the front of the waiting queue with its generated tokens kept;
re-admitted, it recomputes prompt + outputs (prefix hits included) and continues where it
stopped, so its output is unchanged. No new request is admitted in a step that preempted.

A request that wants its prompt's logprobs reads no hits (its every prompt position must
produce logits); a copy of a prompt (``SamplingParams.n``) is admitted only once the first
copy has computed the prompt, so that it reads the prompt from the cache.

A hit never covers a request's last token (it must be computed: it produces the logits),
so a request writes only into blocks past its last hit block: shared blocks stay read-only.
After the whole-block hits, the next block may be a partial hit (``copy_rows`` given, no KV
connector load): the leading rows of a cached block (a full one, or another request's partly
filled last block) that hold the request's next tokens are copied into the request's own new
block, and computing starts after them. A prompt sent again thus computes only its last
token, whatever its length.

With ``token_rows`` (DeepSeek-V4's token caches in blocks of their own: ``token_rows.py``) a
request holds token rows only from the block of ``first_read(its next position)`` on: each
step first releases those it will never read again, then takes token blocks for its new
blocks, and a request that cannot get both waits or preempts as for cache blocks. A prefix
hit is cut back to the longest run whose last blocks still keep the token rows the next step
reads (and a partial hit needs its source's); the pool entries of the blocks before them are
all the request reads of its past.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mlafx.runtime.block_hash import BlockHash
from mlafx.runtime.block_manager import BlockManager
from mlafx.runtime.kv_transfer import KVTransfer
from mlafx.runtime.metrics import EngineStats
from mlafx.runtime.request import Request
from mlafx.runtime.token_rows import TokenRowBlocks


@dataclass(frozen=True)
class ScheduledSequence:
    """Compute the tokens at positions ``start .. end-1`` of ``request`` this step."""

    request: Request
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def samples(self) -> bool:
        """Whether a token is drawn after this span: it reaches the request's last token
        (a prompt chunk short of the end computes rows only)."""
        return self.end >= self.request.num_tokens

    @property
    def all_logits(self) -> bool:
        """Whether every position of the span gets logits: prompt positions of a request
        still collecting its prompt logprobs."""
        return self.request.needs_prompt_logits and self.start < self.request.num_prompt_tokens


def blocks_for_lifetime(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int
) -> int:
    """KV blocks a request can ever fill: every token but the last generated one is cached."""
    cached_tokens = min(num_prompt_tokens + max_tokens, max_model_len) - 1
    return -(-cached_tokens // block_size)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        stats: EngineStats,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        kv_transfer: KVTransfer | None = None,
        copy_rows: Callable[[int, int, int], None] | None = None,
        token_rows: TokenRowBlocks | None = None,
        first_read: Callable[[int], int] | None = None,
    ) -> None:
        """``copy_rows(src, dst, rows)`` copies the first ``rows`` cache rows of block
        ``src`` into block ``dst`` in every layer; without it there are no partial hits.
        ``token_rows``: token rows in blocks of their own, a request's held from
        ``first_read(next position)`` on (``DeepseekV4Config.first_token_row_read``), and
        with a KV connector until the prompt chunk they are in is saved."""
        if (token_rows is None) != (first_read is None):
            raise ValueError("token_rows and first_read go together")
        self.blocks = blocks
        self.stats = stats
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.kv_transfer = kv_transfer
        self.copy_rows = copy_rows
        self.token_rows = token_rows
        self.first_read = first_read
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- one step -----
    def schedule(self) -> list[ScheduledSequence]:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledSequence] = {}
        preempted = False
        # decodes first (one token each), then unfinished prompts; stable: admission order
        queue = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for request in queue:
            if budget == 0:
                break
            if request not in self.running:
                continue  # preempted earlier in this loop
            start = request.num_computed_tokens
            end = self._chunk_end(request, start, budget)
            while not self._grow(request, end):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted = True
                dropped = scheduled.pop(victim.request_id, None)
                if dropped is not None:
                    budget += dropped.num_tokens
                if victim is request:
                    break
            if request in self.running:  # not preempted itself
                scheduled[request.request_id] = ScheduledSequence(request, start, end)
                budget -= end - start
        while (
            not preempted and budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
        ):
            after = self.waiting[0].after
            if after is not None and not after.prompt_computed:
                break  # a copy waits for the first one's prompt, to read it from the cache
            seq = self._admit(self.waiting[0], budget, alone=not scheduled)
            if seq is None:
                break
            self.waiting.popleft()
            self.running.append(seq.request)
            scheduled[seq.request.request_id] = seq
            budget -= seq.num_tokens
        return list(scheduled.values())

    def _grow(self, request: Request, end: int) -> bool:
        """Give ``request`` the blocks positions ``< end`` need (and their token rows, after
        dropping those it will not read again); False if none are free."""
        self._release_token_rows(request, self._first_token_block(request.num_computed_tokens))
        missing = -(-end // self.block_size) - len(request.blocks)
        if missing <= 0:
            return True
        if missing > self.blocks.num_free_blocks:
            return False
        if self.token_rows is not None and missing > self.token_rows.num_available:
            return False
        new = self.blocks.allocate(missing)
        if self.token_rows is not None:
            self.token_rows.allocate(new)
        request.blocks += new
        return True

    def _first_token_block(self, start: int) -> int:
        """The first block whose token rows a step computing from ``start`` reads."""
        return 0 if self.first_read is None else self.first_read(start) // self.block_size

    def _release_token_rows(self, request: Request, first: int) -> None:
        """Release ``request``'s token rows of blocks before ``first`` (with a KV connector,
        not those of prompt chunks still to be saved)."""
        if self.token_rows is None:
            return
        if self.kv_transfer is not None and request.num_saved_blocks < self._whole_chunks(
            request.num_prompt_tokens // self.block_size
        ):
            first = min(first, request.num_saved_blocks)
        first = min(first, len(request.blocks))
        if first > request.token_rows_from:
            self.token_rows.release(request.blocks[request.token_rows_from : first])
            request.token_rows_from = first

    def _readable_hits(self, hits: list[int]) -> int:
        """How many leading ``hits`` can be reused: all, or (token rows in blocks of their
        own) the longest run whose blocks from the next step's first read on keep theirs."""
        if self.token_rows is None:
            return len(hits)
        count = len(hits)
        while count:
            first = self._first_token_block(count * self.block_size)
            lost = next(
                (
                    i
                    for i in range(count - 1, first - 1, -1)
                    if not self.token_rows.has_rows(hits[i])
                ),
                None,
            )
            if lost is None:
                return count
            count = lost  # every longer run reads block ``lost`` too (the bound only grows)
        return 0

    def _admit(self, request: Request, budget: int, *, alone: bool) -> ScheduledSequence | None:
        """Take blocks for ``request``'s prefix hits and first chunk, or None if it must
        wait (not enough free blocks, or a whole prompt over the budget)."""
        bs = self.block_size
        # at least the last token is computed: it produces the logits; a request that
        # wants its prompt's logits computes all of it
        reuse = not request.needs_prompt_logits
        keys = request.block_keys(bs, (request.num_tokens - 1) // bs) if reuse else []
        hits = self.blocks.lookup(keys)
        hits = hits[: self._readable_hits(hits)]
        num_external = 0
        if self.kv_transfer is not None and len(hits) < len(keys) and not request.external_miss:
            num_external = max(self.kv_transfer.lookup(keys) - len(hits), 0)
        partial = reuse and not num_external
        source, rows = self._partial_hit(request, keys, len(hits)) if partial else (0, 0)
        if rows and self.token_rows is not None and not self.token_rows.has_rows(source):
            source, rows = 0, 0
        start = (len(hits) + num_external) * bs + rows
        end = self._chunk_end(request, start, budget)
        if end - start > budget and not alone:
            return None  # a whole prompt over the budget waits for a step of its own
        needed = -(-end // bs) - len(hits)
        held = hits + [source] if rows else hits  # the source is held while it is copied
        if needed + self.blocks.num_free_among(held) > self.blocks.num_free_blocks:
            return None
        first_token_block = self._first_token_block(start)
        token_held = held[first_token_block:]  # those of hits (and the source) it reads
        rows_from = max(first_token_block, len(hits))  # new blocks with token rows of their own
        if self.token_rows is not None and (
            -(-end // bs) - rows_from + self.token_rows.num_available_among(token_held)
            > self.token_rows.num_available
        ):
            return None
        self.blocks.touch(held)
        if self.token_rows is not None:
            self.token_rows.hold(token_held)
        request.blocks = hits + self.blocks.allocate(needed)
        request.token_rows_from = first_token_block
        if self.token_rows is not None:
            # blocks loaded from the store before the first read get no token rows
            self.token_rows.allocate(request.blocks[rows_from:])
        if rows:
            assert self.copy_rows is not None  # partial-block hits need it
            self.copy_rows(source, request.blocks[len(hits)], rows)
            self.blocks.free([source])
            if self.token_rows is not None:
                self.token_rows.release([source])
        if num_external:
            assert self.kv_transfer is not None  # external hits come from it
            external_blocks = request.blocks[len(hits) : len(hits) + num_external]
            loaded = self.kv_transfer.load(
                keys[: len(hits) + num_external], len(hits), external_blocks
            )
            for block, key in zip(external_blocks[:loaded], keys[len(hits) :], strict=False):
                self.blocks.register(block, key)
            if loaded < num_external and self.token_rows is not None:
                # its token rows were loaded only where the whole load's first step reads
                # them: give everything back and be admitted from the local cache alone
                request.external_miss = True
                self._free_blocks(request)
                return self._admit(request, budget, alone=alone)
            if loaded < num_external:  # a partial miss: compute the rest from there
                num_external = loaded
                start = (len(hits) + loaded) * bs
                end = self._chunk_end(request, start, budget)  # never past the old end
                keep = -(-end // bs)
                self.blocks.free(request.blocks[keep:])
                del request.blocks[keep:]
        request.num_computed_tokens = start
        request.num_registered_blocks = len(hits) + num_external
        if not request.admitted:
            request.admitted = True
            request.num_cached_tokens = start
            self.stats.num_requests += 1
            self.stats.lookup_prompt_tokens += request.num_prompt_tokens
            self.stats.prefix_cache_hit_tokens += len(hits) * bs + rows
            self.stats.external_hit_tokens += num_external * bs
        return ScheduledSequence(request, start, end)

    def _partial_hit(
        self, request: Request, keys: list[BlockHash], num_hits: int
    ) -> tuple[int, int]:
        """(cached block, rows) whose leading rows hold the tokens after the whole-block
        hits, short of the last token; (0, 0) if none do."""
        if self.copy_rows is None:
            return 0, 0
        first = num_hits * self.block_size
        last = min(first + self.block_size, request.num_tokens - 1)
        if last <= first:
            return 0, 0
        parent = keys[num_hits - 1] if num_hits else None
        return self.blocks.lookup_rows(parent, request.token_ids(first, last))

    def _chunk_end(self, request: Request, start: int, budget: int) -> int:
        """End of the span computed next from ``start``: the rest of the request's tokens,
        cut at the budget when chunking."""
        if self.enable_chunked_prefill:
            return start + min(request.num_tokens - start, budget)
        return request.num_tokens

    def _preempt(self, request: Request) -> None:
        """Evict a running request: free its blocks, requeue it first, keep its outputs."""
        self.running.remove(request)
        self._free_blocks(request)
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.metrics.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    # ----- after a step -----
    def register_computed_blocks(self, request: Request) -> None:
        """Offer ``request``'s newly completed full blocks to the prefix cache."""
        bs = self.block_size
        full = request.num_computed_tokens // bs
        keys = request.block_keys(bs, full)
        if full > request.num_registered_blocks:
            for i in range(request.num_registered_blocks, full):
                parent = keys[i - 1] if i else None
                tokens = request.token_ids(i * bs, (i + 1) * bs)
                self.blocks.register(request.blocks[i], keys[i], parent, tokens)
            request.num_registered_blocks = full
        if self.copy_rows is not None and request.num_computed_tokens > full * bs:
            # the partly filled last block: its computed rows so far
            tokens = request.token_ids(full * bs, request.num_computed_tokens)
            self.blocks.register_rows(request.blocks[full], keys[-1] if full else None, tokens)

    def _whole_chunks(self, blocks: int) -> int:
        """The leading ``blocks`` in whole KV-connector chunks."""
        assert self.kv_transfer is not None
        chunk = self.kv_transfer.connector.chunk_blocks
        return blocks // chunk * chunk

    def save_prompt(self, request: Request) -> None:
        """Hand a fully computed prompt's full blocks to the KV connector (once). With token
        rows in blocks of their own, each whole chunk of the prompt as soon as it is computed,
        while its blocks keep their rows (a chunk whose rows are already gone, made of
        prefix hits, is skipped: it costs later hits, not this request)."""
        if self.kv_transfer is not None and self.token_rows is not None:
            bs = self.block_size
            computed = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
            whole = self._whole_chunks(computed)
            chunk = self.kv_transfer.connector.chunk_blocks
            while request.num_saved_blocks < whole:
                first = request.num_saved_blocks
                blocks = request.blocks[first : first + chunk]
                if all(self.token_rows.has_rows(b) for b in blocks):
                    self.kv_transfer.save(request.block_keys(bs, first + chunk), blocks, first)
                request.num_saved_blocks = first + chunk
            return
        if (
            self.kv_transfer is None
            or request.prompt_saved
            or request.num_computed_tokens < request.num_prompt_tokens
        ):
            return
        request.prompt_saved = True
        full = request.num_prompt_tokens // self.block_size
        self.kv_transfer.save(request.block_keys(self.block_size, full), request.blocks[:full])

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self._free_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        if self.token_rows is not None:
            self.token_rows.release(request.blocks[request.token_rows_from :])
        request.token_rows_from = 0
        self.blocks.free(request.blocks)
        request.blocks = []

    def abort(self, request: Request) -> None:
        """Drop a waiting or running request, returning its blocks."""
        if request in self.running:
            self.finish(request)
        elif request in self.waiting:
            self.waiting.remove(request)
