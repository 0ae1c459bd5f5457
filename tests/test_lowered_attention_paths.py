"""Both attention paths of the lowered step against the reference model, on steps that mix
decodes, short suffixes over long contexts (absorbed), long fresh prefills and long prefill
chunks with context (split), and steps where a sub-batch is empty, has one row or many.

Everything runs through one AOTInductor package compiled once: a package cannot recompile
(a step outside its exported shape ranges raises), so every step passing is the check that
none needed a recompile. The un-compiled lowered graph is compared as well. Both run each
step with and without the key rows (K = 0, as the engine builds a compiled step's inputs).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mlafx.compile.compiled_step import compile_step
from mlafx.graph.capture import capture_step, sample_step
from mlafx.models.attention_path import AttentionPath, PathCosts, split_threshold
from mlafx.models.step import SequenceSpan, StepInputs, build_step_inputs
from mlafx.passes.pipeline import lower_step_graph
from mlafx.passes.verify import path_coverage, random_caches
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

DENSE = {**TINY_OVERRIDES, "n_routed_experts": 0}
BLOCK_SIZE = 4
NUM_BLOCKS = 1 + 128
SPLIT = AttentionPath.SPLIT

# (context rows, new tokens[, fixed path]) per sequence, and the sub-batch sizes the host
# must give (absorbed sequences, split sequences, split sequences with context). At equal
# costs per MAC the tiny model's rule splits above 63 new tokens (Lkv 32, R 8, P = V = 16).
STEPS = {
    "mixed": (
        [(20, 1), (60, 3), (0, 40), (24, 66), (7, 1)],  # decode, suffix, fresh, chunk, decode
        (3, 2, 1),
    ),
    "only decodes": ([(9, 1), (33, 1)], (2, 0, 0)),
    "one decode": ([(13, 1)], (1, 0, 0)),
    "only fresh prefills": ([(0, 1), (0, 25)], (0, 2, 0)),
    "one chunk with context": ([(5, 70)], (0, 1, 1)),
    "suffix and a short chunk": ([(40, 5), (3, 2), (2, 64)], (2, 1, 1)),
    "one-token prompt": ([(0, 1)], (0, 1, 0)),
    "decodes down the split path": ([(6, 1, SPLIT), (17, 1)], (1, 1, 1)),
}


@pytest.fixture(scope="module")
def model():
    return tiny_llm(hf_overrides=DENSE, num_kv_blocks=8).model


@pytest.fixture(scope="module")
def compiled(model):
    return compile_step(model, BLOCK_SIZE)  # cached in the repo's .cache (tests/conftest.py)


@pytest.fixture(scope="module")
def lowered_graph(model):
    sample, caches = sample_step(model, BLOCK_SIZE)
    result = lower_step_graph(capture_step(model, BLOCK_SIZE).module(), sample, caches)
    assert result.verify_error is None
    return result.graph


def step_inputs(
    shares: list[tuple[int, int]], threshold: float, seed: int, key_rows: bool = True
) -> StepInputs:
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))  # block 0 reserved
    rng.shuffle(free)
    spans = []
    for context, new, *path in shares:
        blocks = [free.pop() for _ in range(-(-(context + new) // BLOCK_SIZE))]
        ids = [rng.randrange(2, 256) for _ in range(new)]
        spans.append(SequenceSpan(ids, context, context + new, blocks, path=next(iter(path), None)))
    return build_step_inputs(spans, BLOCK_SIZE, split_threshold=threshold, key_rows=key_rows)


def run(step, inputs: StepInputs, caches: list[torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return step(inputs.input_ids, inputs.positions, caches, inputs.meta, inputs.logits_indices)


@pytest.mark.parametrize("name", list(STEPS))
def test_both_paths_match_the_reference(model, compiled, lowered_graph, name):
    shares, (absorbed, split, with_context) = STEPS[name]
    threshold = split_threshold(model.config, PathCosts(1.0, 1.0, 1.0))
    assert threshold == 63
    inputs = step_inputs(shares, threshold, seed=len(name))
    meta = inputs.meta
    assert (len(meta.absorbed_kv_lens), len(meta.split_cu_seqlens) - 1, len(meta.context_lens)) == (
        absorbed,
        split,
        with_context,
    )
    template = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, model.config.latent_width)] * len(
        model.model.layers
    )
    start = random_caches(template, seed=7)
    want_caches = [c.clone() for c in start]
    want = run(model, inputs, want_caches)
    # the lowered steps ignore the key rows: the host leaves them out for them (K = 0)
    without_key_rows = step_inputs(shares, threshold, seed=len(name), key_rows=False)
    assert without_key_rows.meta.key_seq_ids.numel() == 0 < inputs.meta.key_seq_ids.numel()
    for step, step_in in itertools.product((compiled, lowered_graph), (inputs, without_key_rows)):
        got_caches = [c.clone() for c in start]
        got = run(step, step_in, got_caches)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for a, b in zip(got_caches, want_caches, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_kind_of_row_was_exercised():
    """The steps above cover each path with and without context, and hold 0, 1 and many rows
    in each sub-batch (absorbed, split, context half)."""
    threshold = 63.0
    total: dict[str, int] = {}
    sizes: list[tuple[int, int, int]] = []
    for shares, _ in STEPS.values():
        meta = step_inputs(shares, threshold, 0).meta
        for kind, count in path_coverage(meta).items():
            total[kind] = total.get(kind, 0) + count
        rows = (meta.absorbed_token_index, meta.split_token_index, meta.context_split_rows)
        sizes.append(tuple(len(r) for r in rows))
    for sub_batch in zip(*sizes, strict=True):
        assert {0, 1} <= set(sub_batch) and max(sub_batch) > 1
    assert total == {
        "absorbed_decodes": 6,
        "absorbed_prefills_with_context": 3,
        "absorbed_fresh_prefills": 0,
        "split_prefills_with_context": 3,
        "split_fresh_prefills": 4,
    }
