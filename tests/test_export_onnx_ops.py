"""The ONNX translations of the mlafx ops (mlafx/export/onnx_ops.py) against the C++ kernels:
each op alone in a module, exported with the translation table, run by onnxruntime, fp32.
Tolerance: 1e-4 absolute and relative (ORT and the kernels sum fp32 in different orders);
LSE exactly -inf where a query sees no key."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mlafx.kernels  # noqa: F401
from mlafx.export.functional_step import cache_with_rows
from mlafx.export.onnx_ops import OPSET, translation_table
from tests.attention_cases import make_paged, make_varlen

onnxruntime = pytest.importorskip("onnxruntime")
ATOL = RTOL = 1e-4


class OpCall(torch.nn.Module):
    """``op(*tensors, *constants)`` as a module: tensors are the ONNX inputs."""

    def __init__(self, op, constants=()):
        super().__init__()
        self.op, self.constants = op, tuple(constants)

    def forward(self, *tensors):
        return self.op(*tensors, *self.constants)


def run_onnx(op, tensors, constants=()):
    program = torch.onnx.export(
        OpCall(op, constants),
        tuple(tensors),
        dynamo=True,
        custom_translation_table=translation_table(),
        opset_version=OPSET,
        optimize=False,
        verbose=False,
    )
    session = onnxruntime.InferenceSession(
        program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    names = [i.name for i in session.get_inputs()]
    feed = dict(zip(names, [t.numpy() for t in tensors], strict=False))
    return [torch.from_numpy(x) for x in session.run(None, feed)]


def assert_close(got, want):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, equal_nan=False)


PAGED_CASES = [
    # (kv_lens, q_lens, block size, position mode)
    ([9], [1], 4, "decode"),
    ([5, 17, 1], [5, 3, 1], 4, "decode"),
    ([16, 3], [2, 3], 1, "context"),
    ([20, 7, 33], [4, 1, 6], 16, "random"),  # includes queries that see nothing
]


@pytest.mark.parametrize(("kv_lens", "q_lens", "block_size", "mode"), PAGED_CASES)
def test_mla_attention_paged(kv_lens, q_lens, block_size, mode):
    case = make_paged(
        kv_lens, q_lens, 3, 8, 4, block_size, torch.float32, seed=1, position_mode=mode
    )
    if mode == "random":  # and one query that sees no key at all
        positions = case.positions.clone()
        positions[0] = -1
        case = dataclasses.replace(case, positions=positions)
    tensors, constants = case.args()[:6], case.args()[6:]
    want = torch.ops.mlafx.mla_attention_paged(*case.args())
    got = run_onnx(torch.ops.mlafx.mla_attention_paged.default, tensors, constants)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    if mode == "random":
        assert torch.isneginf(got[1][:, 0]).all() and (got[0][0] == 0).all()


def test_mla_attention_paged_empty_sub_batch():
    """No query and no sequence (an empty sub-batch) with block-table columns left over."""
    case = make_paged([5], [1], 2, 8, 4, 4, torch.float32, seed=2)
    q = case.q[:0]
    table = case.block_table[:0]
    tensors = (
        q,
        case.kv_cache,
        table,
        case.kv_lens[:0],
        case.query_start_loc[:1],
        case.positions[:0],
    )
    got = run_onnx(torch.ops.mlafx.mla_attention_paged.default, tensors, (case.scale, 8))
    assert got[0].shape == (0, 2, 8) and got[1].shape == (2, 0)


def test_mla_attention_paged_with_rows_sees_the_new_rows():
    case = make_paged([6, 9], [2, 3], 2, 8, 4, 4, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 12, generator=gen)
    # the new tokens' slots: the last q_len positions of each sequence
    table = case.block_table
    slots = [
        int(table[b, p // 4]) * 4 + p % 4
        for b, (n, q) in enumerate(([6, 2], [9, 3]))
        for p in range(n - q, n)
    ]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    slot_mapping[1] = -1  # a skipped token
    op = torch.ops.mlafx_export.mla_attention_paged_with_rows.default
    want = torch.ops.mlafx.mla_attention_paged(
        case.q, cache_with_rows(case.kv_cache, rows, slot_mapping), *case.args()[2:]
    )
    tensors = (case.q, case.kv_cache, rows, slot_mapping, *case.args()[2:6])
    got = run_onnx(op, tensors, case.args()[6:])
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_gather_latent_and_with_rows():
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(5, 4, 12, generator=gen)
    slots = torch.tensor([3, 0, 19, 7, 7], dtype=torch.int64)
    (got,) = run_onnx(torch.ops.mlafx.gather_latent.default, (cache, slots))
    assert_close(got, torch.ops.mlafx.gather_latent(cache, slots))
    rows = torch.randn(2, 12, generator=gen)
    slot_mapping = torch.tensor([7, -1], dtype=torch.int64)
    op = torch.ops.mlafx_export.gather_latent_with_rows.default
    (got,) = run_onnx(op, (cache, rows, slot_mapping, slots))
    want = torch.ops.mlafx.gather_latent(cache_with_rows(cache, rows, slot_mapping), slots)
    assert_close(got, want)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("q_lens", "k_lens"), [([3], [3]), ([2, 0, 4], [5, 3, 4]), ([1, 3], [1, 7])]
)
def test_varlen_attention(q_lens, k_lens, causal):
    case = make_varlen(q_lens, k_lens, 3, 8, 4, 6, torch.float32, causal, seed=5)
    args = case.args()
    want = torch.ops.mlafx.varlen_attention(*args)
    got = run_onnx(torch.ops.mlafx.varlen_attention.default, args[:6], args[6:])
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_merge_attn_states_with_empty_halves():
    gen = torch.Generator().manual_seed(6)
    prefix, suffix = torch.randn(4, 2, 8, generator=gen), torch.randn(4, 2, 8, generator=gen)
    p_lse, s_lse = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    p_lse[0, 1] = float("-inf")  # empty prefix
    s_lse[1, 2] = float("inf")  # empty suffix
    p_lse[1, 3] = s_lse[1, 3] = float("-inf")  # both empty: 0 and -inf
    args = (prefix, p_lse, suffix, s_lse)
    want = torch.ops.mlafx.merge_attn_states(*args)
    got = run_onnx(torch.ops.mlafx.merge_attn_states.default, args)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_moe_experts():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, generator=gen)
    ids = torch.tensor([[0, 2], [1, 1], [3, 0], [2, 3], [0, 1]], dtype=torch.int64)
    weights = torch.rand(5, 2, generator=gen)
    w13, w2 = torch.randn(4, 24, 16, generator=gen), torch.randn(4, 16, 12, generator=gen)
    args = (x, ids, weights, w13, w2)
    (got,) = run_onnx(torch.ops.mlafx.moe_experts.default, args)
    assert_close(got, torch.ops.mlafx.moe_experts(*args))


def test_linear_decode():
    gen = torch.Generator().manual_seed(8)
    weight, x = torch.randn(37, 21, generator=gen), torch.randn(3, 21, generator=gen)
    packed = torch.ops.mlafx.pack_linear_weight(weight)
    (got,) = run_onnx(torch.ops.mlafx.linear_decode.default, (x, packed), (37,))
    assert_close(got, x @ weight.t())
