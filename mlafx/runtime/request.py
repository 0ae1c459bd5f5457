"""One request's state while the engine serves it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlafx.runtime.block_hash import BlockHash, hash_block
from mlafx.runtime.sampling_params import RequestMetrics, SamplingParams


@dataclass(eq=False)  # identity: the scheduler finds requests in its queues by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt_text: str | None = None
    generator: torch.Generator | None = None  # seeded per request when sampling
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    blocks: list[int] = field(default_factory=list)  # KV blocks, in position order
    token_rows_from: int = 0  # the first of ``blocks`` whose token rows it holds (token_rows.py)
    num_computed_tokens: int = 0  # tokens whose latent rows are in the cache
    num_registered_blocks: int = 0  # leading blocks offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens not computed (prefix hits + external loads)
    admitted: bool = False  # scheduled at least once (a preempted request stays True)
    prompt_saved: bool = False  # full prompt blocks handed to the KV connector
    # DeepSeek-V4's token rows apart: leading prompt blocks handed to the KV connector (whole
    # chunks, saved as computed), and whether a load from it fell short (then this request's
    # admissions read the local cache alone)
    num_saved_blocks: int = 0
    external_miss: bool = False
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error")
    # params.prompt_logprobs: per prompt token so far, top-k ids -> logprob (first: None)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a copy of the same prompt (SamplingParams.n) admitted only once ``after`` has
    # computed its prompt, which it then reads from the prefix cache
    after: Request | None = None
    _block_keys: list[BlockHash] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``start .. end-1`` of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:end] if start < num_prompt else []) + (
            self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
        )

    def block_keys(self, block_size: int, count: int) -> list[BlockHash]:
        """Chained content keys (``block_hash``) of the first ``count`` full blocks of
        prompt + output; computed once and kept (tokens never change once known)."""
        if count * block_size > self.num_tokens:
            raise ValueError(f"request {self.request_id}: block {count - 1} is not full")
        keys = self._block_keys
        while len(keys) < count:
            start = len(keys) * block_size
            keys.append(
                hash_block(keys[-1] if keys else None, self.token_ids(start, start + block_size))
            )
        return keys[:count]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions still need logits (for ``prompt_logprobs``): such a
        request computes its prompt, not reading it from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(
            self.prompt_token_ids
        )

    @property
    def prompt_computed(self) -> bool:
        return self.finished or self.num_computed_tokens >= len(self.prompt_token_ids)
