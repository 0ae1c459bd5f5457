"""Capture the step function as an FX graph with ``torch.export`` (non-strict).

Its default pre-dispatch ATen IR keeps ``scaled_dot_product_attention``, ``linear`` and the
in-place ``index_copy_`` into the cache as single nodes, which is what the MLA matcher in
``mlafx.passes`` anchors on. Exactly the step's extents are dynamic (named ``Dim``s):

    T  new tokens       input_ids, positions, slot_mapping, query_seq_ids
    B  sequences        block_table rows, kv_lens; B+1 for query_start_loc
    M  block-table columns
    K  key rows read    key_seq_ids, key_positions
    S  sampled tokens   logits_indices
    NB cache blocks     every cache's first dim
The block size (the caches' second dim) and all model dimensions are static. Tracing runs
under ``backed_size_oblivious`` so that sizes 0 and 1 are not specialised away (a decode
step has T = 1).

Routed experts dispatch on data (which expert each token picked), which does not trace; the
capture records each ``RoutedExperts`` call as one ``mlafx::moe_experts`` node instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.export import Dim, ExportedProgram

from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.moe import RoutedExperts
from mlafx.models.step import SequenceSpan, StepInputs, build_step_inputs


def sample_step_inputs(block_size: int, vocab_size: int) -> StepInputs:
    """A small but general step to trace with: a prefill row with context (3 cached
    tokens, 4 new), a fresh prefill and a decode, spread over non-contiguous blocks."""

    def blocks_for(first: int, num_tokens: int) -> list[int]:
        return [first + 2 * i for i in range(-(-num_tokens // block_size))]

    spans = [
        SequenceSpan([(7 * i) % vocab_size for i in range(3, 7)], 3, 7, blocks_for(1, 7)),
        SequenceSpan([(5 * i + 1) % vocab_size for i in range(5)], 0, 5, blocks_for(2, 5)),
        SequenceSpan([11 % vocab_size], 8, 9, blocks_for(2 + 2 * 8, 9)),
    ]
    return build_step_inputs(spans, block_size)


def num_sample_blocks(block_size: int) -> int:
    """Cache blocks the sample step addresses (its block ids are below this)."""
    return 2 + 2 * 8 + 2 * (-(-9 // block_size)) + 1


def step_dynamic_shapes(num_layers: int) -> dict[str, object]:
    t, b, m, k, s, nb = (Dim(n) for n in ("T", "B", "M", "K", "S", "NB"))
    return {
        "input_ids": {0: t},
        "positions": {0: t},
        "caches": [{0: nb}] * num_layers,
        # StepMetadata fields, in declaration order
        "meta": [{0: t}, {0: t}, {0: b, 1: m}, {0: b}, {0: b + 1}, {0: k}, {0: k}],
        "logits_indices": {0: s},
    }


@contextlib.contextmanager
def experts_as_custom_op() -> Iterator[None]:
    """Within this block every ``RoutedExperts`` runs ``torch.ops.mlafx.moe_experts``."""
    import mlafx.kernels  # noqa: F401  (registers the op and its fake)

    original = RoutedExperts.forward

    def forward(self, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
        return torch.ops.mlafx.moe_experts(
            x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj
        )

    RoutedExperts.forward = forward
    try:
        yield
    finally:
        RoutedExperts.forward = original


def sample_step(model: MLAForCausalLM, block_size: int) -> tuple[StepInputs, list[torch.Tensor]]:
    """The sample step's inputs and zeroed caches just large enough for it (model dtype)."""
    cfg = model.config
    dtype = model.lm_head.weight.dtype
    caches = [
        torch.zeros(num_sample_blocks(block_size), block_size, cfg.latent_width, dtype=dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    return sample_step_inputs(block_size, cfg.vocab_size), caches


def capture_step(model: MLAForCausalLM, block_size: int) -> ExportedProgram:
    """The model's step as an ExportedProgram (pre-dispatch ATen IR, dynamic extents)."""
    cfg = model.config
    sample, caches = sample_step(model, block_size)
    args = (sample.input_ids, sample.positions, caches, sample.meta, sample.logits_indices)
    has_experts = any(isinstance(m, RoutedExperts) for m in model.modules())
    with (
        experts_as_custom_op() if has_experts else contextlib.nullcontext(),
        torch.fx.experimental._config.patch(backed_size_oblivious=True),
        torch.no_grad(),
    ):
        return torch.export.export(
            model, args, dynamic_shapes=step_dynamic_shapes(cfg.num_hidden_layers), strict=False
        )
