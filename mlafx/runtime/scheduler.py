"""Decides which tokens each step computes: running decodes first, then whole prompts,
first come first served, within ``max_num_seqs`` and a per-step token budget.

A request reserves the KV blocks for its whole life (prompt plus ``max_tokens``, capped
by ``max_model_len``) when it is admitted, so a running request never runs out of
blocks; a request whose reservation does not fit waits until others finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlafx.runtime.block_allocator import BlockAllocator
from mlafx.runtime.request import Request


@dataclass(frozen=True)
class ScheduledSequence:
    """Compute the tokens at positions ``start .. end-1`` of ``request`` this step."""

    request: Request
    start: int
    end: int


def blocks_for_lifetime(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int
) -> int:
    """KV blocks a request can ever fill: every token but the last generated one is cached."""
    cached_tokens = min(num_prompt_tokens + max_tokens, max_model_len) - 1
    return -(-cached_tokens // block_size)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        batch = [ScheduledSequence(r, r.num_computed_tokens, r.num_tokens) for r in self.running]
        budget = self.max_num_batched_tokens - len(batch)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_prompt = len(request.prompt_token_ids)
            if batch and num_prompt > budget:
                break  # a prompt alone in a step may exceed the budget; never split (yet)
            needed = blocks_for_lifetime(
                num_prompt, request.params.max_tokens, self.max_model_len, self.block_size
            )
            if needed > self.allocator.num_free_blocks:
                break
            request.blocks = self.allocator.allocate(needed)
            self.waiting.popleft()
            self.running.append(request)
            batch.append(ScheduledSequence(request, 0, num_prompt))
            budget -= num_prompt
        return batch

    def finish(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.blocks)
        request.blocks = []

    def abort_all(self) -> None:
        """Drop every request (after an error), returning their blocks."""
        for request in list(self.running):
            self.finish(request)
        self.waiting.clear()
