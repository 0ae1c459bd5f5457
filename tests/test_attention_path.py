"""The host's cost rule (absorbed vs split) and the sub-batch index tensors it produces."""

from __future__ import annotations

import math

import pytest
import torch

from mlafx.config import ModelConfig
from mlafx.models.attention_path import AttentionPath, PathCosts, choose_path, split_threshold
from mlafx.models.step import SequenceSpan, build_step_inputs

ABSORBED, SPLIT = AttentionPath.ABSORBED, AttentionPath.SPLIT


def config(**dims: int) -> ModelConfig:
    return ModelConfig.from_model("deepseek-v2-lite", dims)


EQUAL = PathCosts(1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    ("dims", "threshold"),
    [
        # 2 Lkv (P+V) / ((2 Lkv + R) - (P + R + V)) - 1
        ({}, 2 * 512 * 256 / (1088 - 320) - 1),  # DeepSeek-V2(-Lite)/V3: ~340
        ({"qk_nope_head_dim": 192, "v_head_dim": 256}, 2 * 512 * 448 / (1088 - 512) - 1),  # GLM
    ],
)
def test_threshold_at_equal_costs_per_mac(dims, threshold):
    assert split_threshold(config(**dims), EQUAL) == pytest.approx(threshold)


def test_threshold_follows_the_kernels_costs():
    cfg = config()  # Lkv 512, R 64, P = V = 128: absorbed pair 1088 MACs, split pair 320
    # a cheaper decompression GEMM splits sooner: 2 * 131072 * 0.25 / 768 - 1
    assert split_threshold(cfg, PathCosts(1.0, 1.0, 0.25)) == pytest.approx(65536 / 768 - 1)
    # a slower varlen kernel splits later: saved per pair 1088 - 2 * 320 = 448
    assert split_threshold(cfg, PathCosts(1.0, 2.0, 1.0)) == pytest.approx(262144 / 448 - 1)
    # when a decompressed pair costs more than an absorbed one, absorbing always wins
    assert split_threshold(cfg, PathCosts(1.0, 3.5, 1.0)) == math.inf
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="positive time per MAC"):
            PathCosts(1.0, 1.0, bad)


@pytest.mark.parametrize(
    ("context", "new_tokens", "path"),
    [
        (4096, 1, ABSORBED),  # decode
        (1, 1, ABSORBED),  # decode over one row
        (0, 1, SPLIT),  # a one-token prompt: decompressed instead of absorbed, no merge
        (4096, 64, ABSORBED),  # short suffix over a long context
        (4096, 100, ABSORBED),  # at the threshold: not above it
        (4096, 101, SPLIT),
        (16, 101, SPLIT),  # the context does not matter: both paths pay the same for it
        (0, 2, SPLIT),  # a fresh prefill is split whenever a decompressed pair is cheaper
        (0, 1024, SPLIT),  # long fresh prefill
    ],
)
def test_choose_path(context, new_tokens, path):
    assert choose_path(context, new_tokens, threshold=100.0) is path


def test_decodes_stay_absorbed_and_bad_shares_are_refused():
    assert choose_path(3, 1, threshold=0.0) is ABSORBED
    assert choose_path(3, 2, threshold=1.0) is SPLIT
    assert choose_path(3, 2, threshold=math.inf) is ABSORBED
    assert choose_path(0, 1000, threshold=math.inf) is ABSORBED
    with pytest.raises(ValueError, match="bad sequence share"):
        choose_path(3, 0, threshold=171.0)


def ids(n: int) -> list[int]:
    return list(range(2, 2 + n))


def test_sub_batches_of_a_mixed_step():
    spans = [
        SequenceSpan(ids(3), 8, 11, [1, 2, 3]),  # suffix over context: absorbed (3 <= 4)
        SequenceSpan(ids(6), 0, 6, [4, 5]),  # fresh prefill: split
        SequenceSpan(ids(1), 9, 10, [6, 7, 8]),  # decode: absorbed
        SequenceSpan(ids(5), 2, 7, [9, 10], sample=False),  # chunk with context: split
    ]
    inputs = build_step_inputs(spans, block_size=4, split_threshold=4.0)
    meta = inputs.meta

    def values(name):
        return getattr(meta, name).tolist()

    assert values("absorbed_token_index") == [0, 1, 2, 9]
    assert values("absorbed_block_table") == [[1, 2, 3], [6, 7, 8]]
    assert values("absorbed_kv_lens") == [11, 10]
    assert values("absorbed_query_start_loc") == [0, 3, 4]
    assert values("split_token_index") == [3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14]
    assert values("split_cu_seqlens") == [0, 6, 11]
    assert values("context_split_rows") == [6, 7, 8, 9, 10]
    assert values("context_block_table") == [[9, 10, 0]]
    assert values("context_lens") == [2]
    assert values("context_query_start_loc") == [0, 5]
    assert inputs.logits_indices.tolist() == [2, 8, 9]
    # DESIGN.md: slots, positions and token indices int64; tables, lens, offsets int32
    for name, value in vars(meta).items():
        int64 = name.endswith(("_index", "_rows", "_ids", "_positions", "slot_mapping"))
        assert value.dtype == (torch.int64 if int64 else torch.int32), name


def test_sub_batches_may_be_empty_and_fixed_paths_override_the_rule():
    decodes = [SequenceSpan(ids(1), 5, 6, [1, 2]), SequenceSpan(ids(1), 3, 4, [3])]
    meta = build_step_inputs(decodes, block_size=4, split_threshold=171.0).meta
    assert meta.absorbed_token_index.tolist() == [0, 1]
    assert meta.split_token_index.shape == (0,) and meta.split_cu_seqlens.tolist() == [0]
    assert meta.context_block_table.shape == (0, 2) and meta.context_lens.shape == (0,)
    forced = [SequenceSpan(ids(1), 5, 6, [1, 2], path=SPLIT), decodes[1]]
    meta = build_step_inputs(forced, block_size=4, split_threshold=171.0).meta
    assert meta.split_token_index.tolist() == [0] and meta.context_split_rows.tolist() == [0]
    assert meta.absorbed_token_index.tolist() == [1]
    # without a threshold (callers that do not tune the compiled step) every row is absorbed
    fresh = [SequenceSpan(ids(4), 0, 4, [1])]
    assert build_step_inputs(fresh, block_size=4).meta.split_token_index.numel() == 0
    meta = build_step_inputs(fresh, block_size=4, split_threshold=171.0).meta
    assert meta.split_cu_seqlens.tolist() == [0, 4] and meta.context_split_rows.numel() == 0
