"""Tensor parallelism over quantized weights (``parallel/quantized_shards.py``): each rank's
packed int8/int4, K-quant and block-FP8 linears and expert stacks hold exactly the full
weight's rows or columns (dequantized, compared with the full weight's slice); a split that
would cut a block is refused before any worker starts; two ranks serve an int4-quantized
model (compiled) and an FP8 checkpoint (reference path) with one process's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from kquant_cases import Q, kquant_weight

from mlafx.kernels.fp8_format import dequantize_fp8, dequantize_gate_up, quantize_fp8
from mlafx.kernels.quant_format import dequantize_weight, quantize_weight_ref
from mlafx.models.fp8 import Fp8Experts, Fp8Linear
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear
from mlafx.parallel.quantized_shards import COLS, ROWS, shard_quantized
from tests.engine_compare import assert_same_greedy, greedy_params, random_prompts, reference_alone
from tests.greedy_compare import compare_greedy
from tests.stored_generation import NEW_TOKENS, PROMPTS, TINY_V3, generate, logprobs_of, top_rows
from tests.test_block_fp8_checkpoint import write_fp8_checkpoint_of
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

WORLD = 2


def _packed(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    if fmt in ("int8", "int4"):
        return quantize_weight_ref(torch.randn(n, k, generator=gen), 8 if fmt == "int8" else 4)
    return kquant_weight(Q.Q4_K if fmt == "k4" else Q.Q6_K, n, k, gen)


def _expected_part(full: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    return full.chunk(WORLD, dim=axis)[rank]


@pytest.mark.parametrize("fmt", ["int8", "int4", "k4", "k8"])
@pytest.mark.parametrize("axis", [ROWS, COLS], ids=["rows", "columns"])
def test_a_packed_linears_shards_are_its_rows_or_columns(fmt, axis):
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 1024  # a rank's columns: two 256-column super-blocks or sixteen groups of 32
    full = QuantizedLinear(k, n, _packed(fmt, n, k, gen))
    whole = dequantize_weight(full.qweight, n, k)
    for rank in range(WORLD):
        part = shard_quantized("lin", full, axis, rank, WORLD)
        assert isinstance(part, QuantizedLinear)
        got = dequantize_weight(part.qweight, part.out_features, part.in_features)
        assert torch.equal(got, _expected_part(whole, axis, rank))
        assert (
            part.qweight.untyped_storage().data_ptr() != full.qweight.untyped_storage().data_ptr()
        )


@pytest.mark.parametrize(("gate_up_fmt", "down_fmt"), [("int4", "int8"), ("k4", "k8")])
def test_a_packed_expert_stacks_shards_split_every_expert_by_its_intermediate_width(
    gate_up_fmt, down_fmt
):
    gen = torch.Generator().manual_seed(4)
    e, d, i = 3, 256, 1024
    gate_up = torch.stack([_packed(gate_up_fmt, 2 * i, d, gen) for _ in range(e)])
    down = torch.stack([_packed(down_fmt, d, i, gen) for _ in range(e)])
    full = QuantizedExperts(i, gate_up, down)
    for rank in range(WORLD):
        part = shard_quantized("experts", full, None, rank, WORLD)
        assert isinstance(part, QuantizedExperts) and part.intermediate_size == i // WORLD
        for x in range(e):
            gate, up = dequantize_weight(gate_up[x], 2 * i, d).chunk(2)
            want = torch.cat([_expected_part(gate, 0, rank), _expected_part(up, 0, rank)])
            assert torch.equal(dequantize_weight(part.gate_up_qweight[x], i, d), want)
            want = _expected_part(dequantize_weight(down[x], d, i), 1, rank)
            assert torch.equal(dequantize_weight(part.down_qweight[x], d, i // WORLD), want)


@pytest.mark.parametrize("axis", [ROWS, COLS], ids=["rows", "columns"])
def test_an_fp8_linears_shards_keep_their_blocks_scales(axis):
    block = (16, 32)
    weight, scale = quantize_fp8(torch.randn(96, 128) * 3, block)
    full = Fp8Linear(weight, scale, block)
    whole = dequantize_fp8(weight, scale, block)
    for rank in range(WORLD):
        part = shard_quantized("lin", full, axis, rank, WORLD)
        assert isinstance(part, Fp8Linear) and part.weight.dtype == torch.float8_e4m3fn
        got = dequantize_fp8(part.weight, part.weight_scale_inv, block)
        assert torch.equal(got, _expected_part(whole, axis, rank))


def test_an_fp8_expert_stacks_shards_split_gate_up_and_down():
    block, e, d, i = (16, 32), 2, 64, 64
    gate_up, gate_up_scale, down, down_scale = [], [], [], []
    for _ in range(e):
        halves = [quantize_fp8(torch.randn(i, d), block) for _ in range(2)]
        gate_up.append(torch.cat([q for q, _ in halves]))
        gate_up_scale.append(torch.cat([s for _, s in halves]))
        q, s = quantize_fp8(torch.randn(d, i), block)
        down.append(q)
        down_scale.append(s)
    stacks = [torch.stack(t) for t in (gate_up, gate_up_scale, down, down_scale)]
    full = Fp8Experts(*stacks, block)
    whole_gate, whole_up = dequantize_gate_up(stacks[0], stacks[1], block).chunk(2, dim=1)
    whole_down = dequantize_fp8(stacks[2], stacks[3], block)
    for rank in range(WORLD):
        part = shard_quantized("experts", full, None, rank, WORLD)
        assert isinstance(part, Fp8Experts) and part.intermediate_size == i // WORLD
        got = dequantize_gate_up(part.gate_up_weight, part.gate_up_scale, block)
        want = torch.cat([_expected_part(w, 1, rank) for w in (whole_gate, whole_up)], dim=1)
        assert torch.equal(got, want)
        got = dequantize_fp8(part.down_weight, part.down_scale, block)
        assert torch.equal(got, _expected_part(whole_down, 2, rank))


def test_a_split_inside_a_block_names_the_tensor():
    gen = torch.Generator().manual_seed(5)
    full = QuantizedLinear(512, 16, _packed("k4", 16, 512, gen))  # 256 columns per rank: fine
    shard_quantized("ok", full, COLS, 0, WORLD)
    with pytest.raises(ValueError, match=r"cannot split mlp\.down_proj: its 512 columns into "
                       r"parts of 128, which are not whole 256-columns blocks"):  # fmt: skip
        shard_quantized("mlp.down_proj", full, COLS, 0, 4)


def test_splits_inside_blocks_are_refused_before_any_worker_starts(tmp_path):
    # the tiny config's routed experts: 16 intermediate columns per rank, int4 groups are 32
    with pytest.raises(ValueError, match=r"inside their 16x32 blocks: .*moe_intermediate_size "
                       r"16 per rank \(blocks of 32 columns\)"):  # fmt: skip
        tiny_llm(quantization="int4", tensor_parallel_size=WORLD)
    write_fp8_checkpoint_of(tmp_path, {"moe_intermediate_size": 24}, [16, 32])
    with pytest.raises(ValueError, match=r"inside their 16x32 blocks: intermediate_size 48 per "
                       r"rank \(blocks of 32 columns\); moe_intermediate_size 12"):  # fmt: skip
        generate(tmp_path, compiled=False, tensor_parallel_size=WORLD)


# Widths whose per-rank parts are whole int4 blocks (16 rows, 32 columns).
ALIGNED = {**TINY_OVERRIDES, "intermediate_size": 128, "moe_intermediate_size": 64}


def test_tp2_over_int4_weights_compiled_matches_one_process():
    """Both ranks quantize the same dummy weights and keep their blocks; batched, chunked,
    prefix-cached serving against each prompt alone in one process (reference path)."""
    prompts = random_prompts(4, 3, 30, seed=11)
    prompts.append(prompts[0] + [7, 8, 9, 10, 11])  # a prefix-cache hit
    options = dict(quantization="int4", hf_overrides=ALIGNED)
    refs = reference_alone(prompts, max_tokens=10, **options)
    llm = tiny_llm(tensor_parallel_size=WORLD, compile=True, max_num_batched_tokens=24, **options)
    try:
        outputs = llm.generate(prompts, greedy_params(10, logprobs=1))
    finally:
        llm.close()
    # The int kernels round each row of activations to int8 per group of 32 (W8A8): the
    # all-reduce's fp32 summation order moves a hidden state by ~1e-7, enough to flip a
    # rounding of the next layer's activations by one step now and then. Unquantized, two
    # ranks' log-probabilities are within 5e-7 of one process's; int4 within 6e-4 (measured
    # on this test's prompts, on the reference path as well: it is the format, not the kernels).
    assert_same_greedy(refs, outputs, "tp2 int4 compiled", tol=2e-3)
    assert outputs[-1].num_cached_tokens > 0


def test_tp2_serves_an_fp8_checkpoint_as_one_process_does(tmp_path):
    """DeepSeek's FP8 layout with [16, 32] blocks, widths that split at whole blocks, served
    by two ranks and by one (reference path, chunked prompts and prefix hits)."""
    overrides = {"intermediate_size": 128, "moe_intermediate_size": 64}
    write_fp8_checkpoint_of(tmp_path, overrides, [16, 32])
    one = generate(tmp_path, compiled=False)
    two = generate(tmp_path, compiled=False, tensor_parallel_size=WORLD)
    compared = 0
    for i in range(len(PROMPTS)):
        compared += compare_greedy(
            one[i].outputs[0].token_ids, top_rows(one[i], TINY_V3["vocab_size"]),
            two[i].outputs[0].token_ids, logprobs_of(two[i]), label=f"fp8 tp2 #{i}",
        ).compared  # fmt: skip
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4
