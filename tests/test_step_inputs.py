"""The host's step inputs: key rows (one per cached token) only for a step that reads them.

A compiled step's inputs grow with the batch and the new tokens (plus one block id per
cached block in the block tables), never with the cached tokens; the reference model still
gets the key rows and refuses inputs without them. The compiled step's logits without key
rows are checked in ``test_lowered_attention_paths``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlafx.models.step import SequenceSpan, StepInputs, build_step_inputs
from mlafx.runtime.engine_core import EngineCore
from mlafx.runtime.request import Request
from mlafx.runtime.sampling_params import RequestMetrics, SamplingParams
from tests.tiny_models import tiny_llm

BLOCK_SIZE = 16
CONTEXT = 5000
BLOCK_TABLES = ("block_table", "absorbed_block_table", "context_block_table")


def long_context_step(key_rows: bool) -> StepInputs:
    """Batch 4 over 5000 cached tokens each: three decodes and a 64-token chunk (split)."""
    spans = []
    for b, new in enumerate((1, 1, 1, 64)):
        num_blocks = -(-(CONTEXT + new) // BLOCK_SIZE)
        blocks = list(range(1 + b * num_blocks, 1 + (b + 1) * num_blocks))
        spans.append(SequenceSpan([5] * new, CONTEXT, CONTEXT + new, blocks))
    return build_step_inputs(spans, BLOCK_SIZE, split_threshold=10.0, key_rows=key_rows)


def fields(inputs: StepInputs) -> dict[str, torch.Tensor]:
    meta = {f.name: getattr(inputs.meta, f.name) for f in dataclasses.fields(inputs.meta)}
    return {
        "input_ids": inputs.input_ids,
        "positions": inputs.positions,
        "logits_indices": inputs.logits_indices,
        **meta,
    }


def test_compiled_path_inputs_are_bounded_by_batch_and_new_tokens():
    inputs = long_context_step(key_rows=False)
    batch, new_tokens = 4, 67
    assert inputs.input_ids.shape == (new_tokens,)
    assert inputs.meta.split_token_index.numel() == 64  # both paths present
    max_blocks = -(-(CONTEXT + 64) // BLOCK_SIZE)
    for name, value in fields(inputs).items():
        if name in BLOCK_TABLES:  # one id per cached block: [sequences, M]
            assert value.shape[0] <= batch and value.shape[1] == max_blocks, name
        else:
            assert value.dim() == 1 and value.numel() <= new_tokens + batch + 1, name
    assert inputs.meta.key_seq_ids.shape == inputs.meta.key_positions.shape == (0,)
    assert inputs.meta.key_seq_ids.dtype == inputs.meta.key_positions.dtype == torch.int64


def test_the_reference_path_gets_the_key_rows_and_nothing_else_differs():
    full, lean = long_context_step(key_rows=True), long_context_step(key_rows=False)
    ends = [CONTEXT + 1] * 3 + [CONTEXT + 64]
    want_seq = torch.cat([torch.full((end,), b) for b, end in enumerate(ends)])
    want_pos = torch.cat([torch.arange(end) for end in ends])
    assert torch.equal(full.meta.key_seq_ids, want_seq)
    assert torch.equal(full.meta.key_positions, want_pos)
    for name, value in fields(full).items():
        if not name.startswith("key_"):
            other = fields(lean)[name]
            assert value.dtype == other.dtype and torch.equal(value, other), name


@pytest.fixture(scope="module")
def model():
    return tiny_llm(num_kv_blocks=8).model


def test_the_reference_model_refuses_inputs_without_key_rows(model):
    spans = [SequenceSpan([3, 4, 5], 0, 3, [1]), SequenceSpan([6], 4, 5, [2, 3])]
    caches = [torch.zeros(8, 4, model.config.latent_width) for _ in model.model.layers]
    lean = build_step_inputs(spans, 4, key_rows=False)
    args = (lean.input_ids, lean.positions, caches, lean.meta, lean.logits_indices)
    with pytest.raises(ValueError, match=r"0, 0 rows\) do not cover .* 8 cached tokens"):
        model(*args)
    full = build_step_inputs(spans, 4)
    with torch.no_grad():
        logits = model(full.input_ids, full.positions, caches, full.meta, full.logits_indices)
    assert logits.shape == (2, model.config.vocab_size)


class RecordingStep:
    """A step that records how many key rows it was given; runs the model when it reads
    them, otherwise returns uniform logits."""

    def __init__(self, model: torch.nn.Module, reads_key_rows: bool) -> None:
        self.model, self.reads_key_rows = model, reads_key_rows
        self.key_rows: list[int] = []

    def __call__(self, input_ids, positions, caches, meta, logits_indices):  # type: ignore[no-untyped-def]
        self.key_rows.append(meta.key_seq_ids.numel())
        if self.reads_key_rows:
            return self.model(input_ids, positions, caches, meta, logits_indices)
        return torch.zeros(len(logits_indices), self.model.config.vocab_size)


@pytest.mark.parametrize("reads_key_rows", [True, False])
def test_the_engine_builds_key_rows_only_for_a_step_that_reads_them(model, reads_key_rows):
    step = RecordingStep(model, reads_key_rows)
    engine = EngineCore(
        model.config,
        step,
        dtype=torch.float32,
        block_size=4,
        num_blocks=8,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add(Request("a", [3, 4, 5, 6, 7], params, RequestMetrics(0.0)))
    while engine.has_unfinished():
        engine.step()
    # prefill of 5 rows, then decodes over 6 and 7 rows
    assert step.key_rows == ([5, 6, 7] if reads_key_rows else [0, 0, 0])
