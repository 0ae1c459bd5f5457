"""The serving options of an engine (everything but the model), validated in one place."""

from __future__ import annotations

from dataclasses import dataclass

from mlafx.config import ServedConfig, kv_bytes_per_block

DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes, when neither num_kv_blocks nor kv_cache_memory is given


@dataclass(frozen=True)
class ServingOptions:
    """``block_size``: tokens per KV block (1..256). ``max_model_len``: prompt + output
    tokens per request (None: the model's ``max_position_embeddings``). The cache holds
    ``num_kv_blocks`` blocks, or as many as fit in ``kv_cache_memory`` bytes (1 GiB by
    default). Each step computes at most ``max_num_batched_tokens`` new tokens for at most
    ``max_num_seqs`` running requests; ``enable_chunked_prefill`` splits a prompt over
    steps, ``enable_prefix_caching`` reuses computed full blocks across requests.
    ``batch_invariant``: a request's tokens and logprobs are bitwise the same whatever else is
    in the batch, however its prompt is chunked and wherever its prefix came from (every
    sequence takes the absorbed attention path and the kernels run in batch-invariant mode,
    ``mlafx.kernels.set_batch_invariant``); slower."""

    block_size: int = 16
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= 256:
            raise ValueError(f"block_size must be in 1..256, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")

    def resolved_max_model_len(self, cfg: ServedConfig) -> int:
        limit = cfg.max_position_embeddings
        length = limit if self.max_model_len is None else self.max_model_len
        if not 2 <= length <= limit:
            raise ValueError(
                f"max_model_len must be in 2..{limit} (max_position_embeddings), got {length}"
            )
        return length

    def num_blocks(self, cfg: ServedConfig, dtype: str) -> int:
        """KV blocks of the cache (block 0 included, and reserved)."""
        if self.num_kv_blocks is not None:
            blocks = self.num_kv_blocks
        else:
            memory = (
                DEFAULT_KV_CACHE_MEMORY if self.kv_cache_memory is None else self.kv_cache_memory
            )
            blocks = memory // kv_bytes_per_block(cfg, dtype, self.block_size)
        if blocks < 2:
            raise ValueError(
                f"the KV cache holds {blocks} block(s) of {self.block_size} tokens; at least 2 "
                "are needed (block 0 is reserved): raise num_kv_blocks or kv_cache_memory"
            )
        return int(blocks)
