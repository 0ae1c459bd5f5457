"""The engines under test, behind one small interface: each hands out a zero-argument
callable that runs one prefill or one decode step (a forward pass, no sampling).

- ``MlafxStep``: mlafx's step function (the compiled step, or the reference model with
  ``compile=False``) on a paged latent cache filled with random rows; each call rewrites the
  same slots, so repeats are identical.
- ``TransformersModel``: a transformers ``*ForCausalLM`` (eager, or ``torch.compile`` of it)
  with a ``DynamicCache`` of random latents; a decode call appends one row, then puts the
  cache's original tensors back.

Both build a decode batch's context without prefilling it: the cost of a step depends on
the cache's length, not on the values in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlafx.config import ModelConfig
from mlafx.kernels import batch_invariant_mode
from mlafx.models.attention_path import split_threshold
from mlafx.models.step import SequenceSpan, StepFn, build_step_inputs
from mlafx.runtime.attention_costs import attention_path_costs

Run = Callable[[], object]


def token_ids(batch: int, length: int, vocab: int, salt: int = 0) -> list[list[int]]:
    """Deterministic, distinct token-id rows (no two share a prefix)."""
    return [[(7919 * (b + 1 + salt) + 31 * i) % vocab for i in range(length)] for b in range(batch)]


def blocks_needed(batch: int, tokens: int, block_size: int) -> int:
    """Blocks ``MlafxStep`` uses for ``batch`` sequences of ``tokens`` rows (block 0 reserved)."""
    return 1 + batch * -(-tokens // block_size)


@dataclass
class MlafxStep:
    """One of mlafx's step functions over the engine's own KV cache tensors."""

    name: str
    step_fn: StepFn
    caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, Lkv + R]
    config: ModelConfig
    block_size: int
    # the engine's batch-invariant mode: every span absorbed, the kernels' mode on per call
    batch_invariant: bool = False

    def fill_caches(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        for cache in self.caches:
            cache.normal_(generator=gen)

    def _split_threshold(self) -> float:
        """The engine's cost rule (``EngineCore``), with this host's measured costs."""
        return split_threshold(self.config, attention_path_costs(self.config, self.caches[0].dtype))

    def _run(self, spans: list[SequenceSpan]) -> Run:
        need = 1 + sum(len(s.blocks) for s in spans)
        if need > self.caches[0].shape[0]:
            held = self.caches[0].shape[0]
            raise ValueError(f"{self.name}: {need} KV blocks needed, the cache holds {held}")
        inputs = build_step_inputs(
            spans,
            self.block_size,
            None if self.batch_invariant else self._split_threshold(),
            key_rows=self.step_fn.reads_key_rows,
        )
        args = (inputs.input_ids, inputs.positions, self.caches, inputs.meta)

        def run() -> object:
            with batch_invariant_mode(self.batch_invariant):
                return self.step_fn(*args, inputs.logits_indices)

        return run

    def _spans(self, rows: list[list[int]], start: int) -> list[SequenceSpan]:
        per_seq = -(-(start + len(rows[0])) // self.block_size)
        blocks = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(len(rows))]
        return [SequenceSpan(ids, start, start + len(ids), blocks[b]) for b, ids in enumerate(rows)]

    def prefill(self, batch: int, length: int) -> Run:
        return self._run(self._spans(token_ids(batch, length, self.config.vocab_size), 0))

    def decode(self, batch: int, context: int) -> Run:
        return self._run(self._spans(token_ids(batch, 1, self.config.vocab_size), context))


@dataclass
class TransformersModel:
    """A transformers causal LM (eager or ``torch.compile``-d) over its ``DynamicCache``."""

    name: str
    model: Callable[..., object]
    hf_config: object
    config: ModelConfig
    dtype: torch.dtype

    def _cache(self, batch: int, context: int):  # type: ignore[no-untyped-def]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf_config)
        if context == 0:
            return cache
        gen = torch.Generator().manual_seed(context)
        for layer in range(self.config.num_hidden_layers):
            latent = torch.randn(batch, 1, context, self.config.kv_lora_rank, generator=gen)
            rope = torch.randn(batch, 1, context, self.config.qk_rope_head_dim, generator=gen)
            cache.update(latent.to(self.dtype), rope.to(self.dtype), layer)
        return cache

    def prefill(self, batch: int, length: int) -> Run:
        ids = torch.tensor(token_ids(batch, length, self.config.vocab_size))

        def run() -> object:
            cache = self._cache(batch, 0)
            return self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

        return run

    def decode(self, batch: int, context: int) -> Run:
        ids = torch.tensor(token_ids(batch, 1, self.config.vocab_size))
        cache = self._cache(batch, context)

        held = [(layer.keys, layer.values) for layer in cache.layers]

        def run() -> object:
            out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            # back to the same `context` rows (the very tensors: same shapes and strides, so
            # a compiled model sees identical inputs and every repeat is the same step)
            for layer, (keys, values) in zip(cache.layers, held, strict=True):
                layer.keys, layer.values = keys, values
            return out

        return run

    def kv_bytes_per_token(self, length: int = 16) -> float:
        """Bytes its cache holds per token, measured on a short prefill."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.hf_config)
        ids = torch.tensor(token_ids(1, length, self.config.vocab_size))
        with torch.inference_mode():
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return held / length
