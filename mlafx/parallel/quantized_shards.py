"""Tensor-parallel shards of the quantized modules, cut from their stored bytes.

A quantized linear or expert stack splits along the same axis as its full-precision twin
(``sharding``), but only at its format's block boundaries, where a rank's part is a whole
number of blocks and nothing is dequantized or requantized:

    int8 / int4 (``kernels/quant_format``)    blocks of 16 rows x 32 columns
    k4 / k8 (GGUF K-quants, ``kquant_format``) 16 rows x 256 columns (one super-block)
    block FP8 (``kernels/fp8_format``)        the checkpoint's block, e.g. 128 x 128

Each rank's blocks are the full model's blocks, and a row-parallel rank's groups of columns
(over which the int kernels quantize the activations) are the full model's groups, so a rank
computes exactly the full model's terms for its rows or columns; the ranks' sums differ from
one process's only in fp32 summation order. A split that would cut a block is refused with
the tensor, the widths and the block named (``sharding.check_shardable`` checks the widths up front
when ``format_blocks`` knows the block from the config).
"""

from __future__ import annotations

import torch
from torch import nn

from mlafx.config.stored_quantization import BlockFp8, PackedInt4
from mlafx.kernels.kquant_format import SUPER, kquant_name
from mlafx.kernels.quant_format import BLOCK_ROWS, GROUP
from mlafx.models.fp8 import Fp8Experts, Fp8Linear
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear

ROWS, COLS = 0, 1
AXIS_WORDS = {ROWS: "rows", COLS: "columns"}
QUANTIZED_MODULES = (QuantizedLinear, QuantizedExperts, Fp8Linear, Fp8Experts)


class _Cut:
    """Rank ``rank``'s contiguous 1/``world`` part of an axis of ``total`` rows or columns,
    checked to be a whole number of ``block``-wide blocks."""

    def __init__(self, name: str, total: int, axis: int, block: int, rank: int, world: int):
        self.part = total // world
        if self.part % block:
            raise ValueError(
                f"tensor_parallel_size={world} cannot split {name}: its {total} "
                f"{AXIS_WORDS[axis]} into parts of {self.part}, which are not whole "
                f"{block}-{AXIS_WORDS[axis]} blocks of its quantized format"
            )
        self.start = rank * self.part
        self.block = block

    def take(
        self, t: torch.Tensor, dim: int, blocked: bool = True, offset: int = 0
    ) -> torch.Tensor:
        """The part of ``t`` along ``dim``: in blocks (a packed tensor or a scale) or in
        single rows/columns (FP8 bytes); ``offset`` whole blocks/rows in (an up half)."""
        unit = self.block if blocked else 1
        return t.narrow(dim, offset + self.start // unit, self.part // unit)


def _columns_block(packed: torch.Tensor) -> int:
    return SUPER if kquant_name(packed) is not None else GROUP


def _shard_packed_linear(
    name: str, m: QuantizedLinear, axis: int, rank: int, world: int
) -> QuantizedLinear:
    if axis == ROWS:
        cut = _Cut(name, m.out_features, ROWS, BLOCK_ROWS, rank, world)
        return QuantizedLinear(m.in_features, cut.part, cut.take(m.qweight, 0).clone())
    cut = _Cut(name, m.in_features, COLS, _columns_block(m.qweight), rank, world)
    return QuantizedLinear(cut.part, m.out_features, cut.take(m.qweight, 1).clone())


def _shard_packed_experts(
    name: str, m: QuantizedExperts, rank: int, world: int
) -> QuantizedExperts:
    i = m.intermediate_size
    rows = _Cut(f"{name}.gate_up", i, ROWS, BLOCK_ROWS, rank, world)  # I % 16 == 0 follows
    gate_up = torch.cat(
        [rows.take(m.gate_up_qweight, 1, offset=half * i // BLOCK_ROWS) for half in (0, 1)], dim=1
    )
    cols = _Cut(f"{name}.down", i, COLS, _columns_block(m.down_qweight), rank, world)
    return QuantizedExperts(rows.part, gate_up, cols.take(m.down_qweight, 2).clone())


def _shard_fp8_linear(name: str, m: Fp8Linear, axis: int, rank: int, world: int) -> Fp8Linear:
    total = m.out_features if axis == ROWS else m.in_features
    cut = _Cut(name, total, axis, m.block[axis], rank, world)
    weight = cut.take(m.weight, axis, blocked=False).clone()
    return Fp8Linear(weight, cut.take(m.weight_scale_inv, axis).clone(), m.block)


def _shard_fp8_experts(name: str, m: Fp8Experts, rank: int, world: int) -> Fp8Experts:
    i, (bn, bk) = m.intermediate_size, m.block
    rows = _Cut(f"{name}.gate_up", i, ROWS, bn, rank, world)  # I % bn == 0 follows
    gate_up = torch.cat(
        [rows.take(m.gate_up_weight, 1, blocked=False, offset=h * i) for h in (0, 1)], dim=1
    )
    gate_up_scale = torch.cat(
        [rows.take(m.gate_up_scale, 1, offset=h * i // bn) for h in (0, 1)], dim=1
    )
    cols = _Cut(f"{name}.down", i, COLS, bk, rank, world)
    down = cols.take(m.down_weight, 2, blocked=False).clone()
    return Fp8Experts(gate_up, gate_up_scale, down, cols.take(m.down_scale, 2).clone(), m.block)


def shard_quantized(
    name: str, module: nn.Module, axis: int | None, rank: int, world: int
) -> nn.Module:
    """Rank ``rank``'s part of the quantized module ``name`` (its own tensors): a linear split
    along ``axis`` (``ROWS`` / ``COLS``; None: replicated, returned as it is) or a routed
    expert stack (split by its intermediate width, like ``RoutedExperts``)."""
    if isinstance(module, QuantizedExperts):
        return _shard_packed_experts(name, module, rank, world)
    if isinstance(module, Fp8Experts):
        return _shard_fp8_experts(name, module, rank, world)
    if axis is None:
        return module
    if isinstance(module, QuantizedLinear):
        return _shard_packed_linear(name, module, axis, rank, world)
    if isinstance(module, Fp8Linear):
        return _shard_fp8_linear(name, module, axis, rank, world)
    raise TypeError(f"{name}: {type(module).__name__} is not a quantized module")


def format_blocks(quantization: str | None, stored: object) -> tuple[int, int] | None:
    """(rows, columns) of the blocks a model's quantized weights split at, when the config
    tells (on-load int8/int4, compressed-tensors int4 repacked to int4, block FP8); None for
    an unquantized model or a GGUF file (its tensors' types say: checked as each splits)."""
    if isinstance(stored, BlockFp8):
        return stored.block
    if quantization is not None or isinstance(stored, PackedInt4):
        return BLOCK_ROWS, GROUP
    return None
