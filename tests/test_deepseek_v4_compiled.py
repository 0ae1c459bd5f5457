"""DeepSeek-V4's layer capture and passes (``graph/capture_v4.py``, ``passes/v4_pipeline.py``):
every layer kind of the tiny model traces with the step's dynamic extents, lowers to mlafx's
ops, and its check catches a wrong lowering. The compiled engine's tokens are
``test_deepseek_v4_engine.py``'s."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from v4_cases import mlafx_v4, transformers_v4
from v4_checkpoints import WIDTHS

from mlafx.graph.capture_v4 import sample_layer_args
from mlafx.passes.v4_pipeline import lower_v4_layer, verify_error

BLOCK = 8


@pytest.fixture(scope="module")
def model():
    return mlafx_v4(transformers_v4(seed=0))


def _ops(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("index", [0, 1, 2])  # sliding + hash MoE, CSA + MoE, HCA + MoE
def test_each_layer_type_lowers_to_the_ops(model, index):
    cfg = model.config
    lowering = lower_v4_layer(model, index, BLOCK)
    assert lowering.verify_error is None
    ops = _ops(lowering.lowered)
    rate = cfg.compress_rate(index)
    # attention: one pass over the window rows (and on compressed layers the pool entries)
    assert ops["mlafx.v4_attention.default"] == 1
    assert ops["mlafx.mla_attention_sparse.default"] == ops["mlafx.merge_attn_states.default"] == 0
    assert ops["mlafx.dsa_indexer_topk.default"] == (1 if rate == 4 else 0)
    # the compressors' window closes: the pool's, and on CSA the indexer's keys'
    assert ops["mlafx.v4_compress_pool.default"] == {0: 0, 4: 2}.get(rate, 1)
    (experts,) = [n for n in lowering.lowered.graph.nodes if "moe_experts" in str(n.target)]
    assert experts.args[-1] == cfg.swiglu_limit  # the clamp reaches the op
    # every linear over a weight is packed; not the grouped o_a_proj's per-group slices, nor
    # the two mHC mixes (float32 casts of their weights)
    assert ops["mlafx.linear_packed.default"] == lowering.linears > 0
    off_blocks = sum(1 for g in range(cfg.o_groups) if g * cfg.o_lora_rank % 16)  # rank 12
    assert ops["aten.linear.default"] == off_blocks + 2


def test_grouped_o_a_proj_on_packed_blocks_is_lowered_too():
    """o_lora_rank 32: each group's rows start on a packed block, so its slice of the packed
    weight serves it (V4-Flash: 1024)."""
    model = mlafx_v4(transformers_v4(seed=1, **WIDTHS))
    lowering = lower_v4_layer(model, 1, BLOCK)
    assert lowering.verify_error is None
    assert _ops(lowering.lowered)["aten.linear.default"] == 2  # the mHC mixes only


def test_the_sample_step_closes_entries_of_every_pool(model):
    """Each dynamic extent the capture traces is at least 2 (none specialised to 0 or 1)."""
    cfg = model.config
    for index in (1, 2):
        x, _, _, leaves = sample_layer_args(model, index, BLOCK)
        close_slots, pool_table, visible = leaves[6], leaves[10], leaves[-1]
        assert x.shape[0] >= 2 and close_slots.shape[0] >= 2 and pool_table.shape[1] >= 2
        if cfg.layer_types[index] == "heavily_compressed_attention":
            assert visible.shape[1] >= 2


class _Off(torch.nn.Module):
    """A "lowering" that is off by 1% in its output."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, input_ids, caches, leaves):  # type: ignore[no-untyped-def]
        return self.inner(x, input_ids, caches, leaves) * 1.01


def test_verify_catches_a_wrong_lowering(model):
    lowering = lower_v4_layer(model, 0, BLOCK)
    args = sample_layer_args(model, 0, BLOCK)
    assert verify_error(lowering.captured, lowering.lowered, args) is None
    error = verify_error(lowering.captured, _Off(lowering.lowered), args)
    assert error is not None and "output differs" in error


def test_inspect_shows_each_layer_kind_and_its_ops(tmp_path, capsys):
    import json

    from mlafx.cli import main

    transformers_v4(seed=0).save_pretrained(tmp_path)
    flags = ["--model", str(tmp_path), "--dtype", "float32", "--block-size", str(BLOCK)]
    assert main(["inspect", *flags, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    kinds = {k["name"]: k for k in report["layer_kinds"]}
    assert sorted(kinds) == [
        "compressed_sparse_attention+hash_moe",
        "compressed_sparse_attention+moe",
        "heavily_compressed_attention+moe",
        "sliding_attention+hash_moe",
    ]
    csa = kinds["compressed_sparse_attention+moe"]
    assert csa["layers"] == [1] and csa["verify"]["ok"] and report["verify"]["ok"]
    assert csa["mlafx_ops"]["mlafx.dsa_indexer_topk.default"] == 1
    assert main(["inspect", *flags, "--stage", "lower_linears"]) == 0
    text = capsys.readouterr().out
    assert "layer kind heavily_compressed_attention+moe (layers [2])" in text
    assert text.count("== stage") == 4  # one lower_linears stage per kind


def test_export_refuses_v4_naming_what_serves_it(tmp_path, capsys):
    from mlafx.cli import main

    transformers_v4(seed=0).save_pretrained(tmp_path / "v4")
    flags = ["--model", str(tmp_path / "v4"), "--format", "pt2", "--output", str(tmp_path / "a")]
    assert main(["export", *flags]) == 2
    error = capsys.readouterr().err
    assert "'deepseek_v4' is not an MLA step's model" in error and "export" in error
    assert not (tmp_path / "a").exists()
