"""Weight-only quantization of a model's linears and routed experts (int8 / int4), applied
tensor by tensor as the weights load, so the full-precision model never exists at once.

What is quantized (``QUANTIZED``): every ``nn.Linear`` over a checkpoint weight — q/kv_a/o
projections, dense MLPs, shared experts, lm_head — and the routed experts' fused stacks.
What is not:
- the router (``moe.Router``, fp32: routing decisions are discontinuous), a DSA indexer's
  ``weights_proj`` (fp32 too: it weighs the scores that pick the keys) and the norms;
- the embedding (a row lookup: it reads one row per token, never the whole table);
- ``kv_b_proj``: decode never reads it (it is absorbed into ``W_UK`` / ``W_UV^T``, derived
  constants the attention kernels read in the model dtype), only the split prefill path's
  decompression does, and it is 1.3% of DeepSeek-V2-Lite's weights (2 M of 15.7 B per layer).
  Quantizing it would make the absorbed weights approximations of approximations for
  0.7% of the model's bytes.
Formats and the activations' rounding: ``mlafx.kernels.quant_format``.

Eager, the quantized modules run the plain-PyTorch reference (dequantize, matmul); the
capture (``graph/capture.py``) records them as the ``mlafx::linear_quantized`` and
``mlafx::moe_experts_quantized`` kernels instead, so the compiled step and the reference share
the quantized bytes and differ only in fp32 summation order.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.kernels.quant_format import BITS, linear_quantized_reference, packed_shape
from mlafx.models.moe import RoutedExperts, check_expert_ids, grouped_by_expert

log = logging.getLogger(__name__)

Quantization = Literal["int8", "int4"]
QUANTIZATIONS = tuple(BITS)
# Linears kept in the model dtype, by module name (see the module docstring).
_KEPT = ("kv_b_proj", "weights_proj")


def check_quantization(quantization: str | None) -> int | None:
    """The bits of ``quantization`` (None: not quantized); a clear error for anything else."""
    if quantization is None:
        return None
    if quantization not in BITS:
        raise ValueError(
            f"quantization {quantization!r} is not supported; use one of "
            f"{', '.join(QUANTIZATIONS)} (or None for the model dtype)"
        )
    return BITS[quantization]


class QuantizedLinear(nn.Module):
    """``nn.Linear`` (no bias) over a packed int8/int4 weight ``qweight``
    [ceil(out/16), ceil(in/32), S] uint8."""

    qweight: torch.Tensor  # a buffer

    def __init__(self, in_features: int, out_features: int, qweight: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", qweight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_quantized_reference(x, self.qweight, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class QuantizedExperts(nn.Module):
    """``RoutedExperts`` over packed weights: ``gate_up_qweight`` [E, ceil(2I/16), ceil(D/32), S]
    and ``down_qweight`` [E, ceil(D/16), ceil(I/32), S]."""

    gate_up_qweight: torch.Tensor  # buffers
    down_qweight: torch.Tensor

    def __init__(self, intermediate_size: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.register_buffer("gate_up_qweight", gate_up)
        self.register_buffer("down_qweight", down)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_experts_quantized_reference(
            x, topk_ids, topk_weights, self.gate_up_qweight, self.down_qweight,
            self.intermediate_size,
        )  # fmt: skip


def moe_experts_quantized_reference(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, ceil(2I/16), ceil(D/32), S] uint8: gate rows, then up rows
    w2: torch.Tensor,  # [E, ceil(D/16), ceil(I/32), S] uint8
    intermediate_size: int,  # I
) -> torch.Tensor:
    """Routed experts over quantized weights -> [T, D] in x's dtype (the semantics of
    ``mlafx::moe_experts_quantized``), grouped by expert as ``moe.routed_experts_reference``,
    each linear ``linear_quantized_reference``: ``[g | u] = x @ W13^T`` (rounded to x's
    dtype), ``h = silu(g) * u`` in x's dtype, ``y = h @ W2^T`` (x's dtype), then
    ``sum_j topk_weights * y`` in float32, rounded once. An id outside ``[0, E)`` raises
    ``IndexError``."""
    num_experts = w13.shape[0]
    check_expert_ids(topk_ids, num_experts)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = linear_quantized_reference(rows, w13[expert], 2 * intermediate_size)
        gate, up = gate_up.chunk(2, dim=-1)
        return linear_quantized_reference(F.silu(gate) * up, w2[expert], x.shape[1])

    return grouped_by_expert(x, topk_ids, topk_weights, num_experts, expert_mlp)


def quantization_targets(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """Full-precision tensor name -> (owner module name, owner) for everything quantized."""
    targets: dict[str, tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf not in _KEPT:
            targets[f"{name}.weight"] = (name, module)
        elif isinstance(module, RoutedExperts):
            targets[f"{name}.gate_up_proj"] = (name, module)
            targets[f"{name}.down_proj"] = (name, module)
    return targets


def quantize_weight(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [N, K] -> packed uint8 (``mlafx::quantize_linear_weight``)."""
    from mlafx.kernels.quant_ops import quantize_linear_weight

    return quantize_linear_weight(weight, bits)


def quantize_stack(weights: torch.Tensor, bits: int) -> torch.Tensor:
    """weights [E, N, K] -> packed [E, ceil(N/16), ceil(K/32), S], one expert at a time."""
    e, n, k = weights.shape
    out = torch.empty((e, *packed_shape(n, k, bits)), dtype=torch.uint8)
    for expert in range(e):
        out[expert] = quantize_weight(weights[expert], bits)
    return out


class Quantizer:
    """Quantizes a model's targets as each one finishes loading (``finish``), swapping the owner
    module for its quantized form; the full-precision tensor is then dropped (a mapped one is
    unmapped), so a load holds the quantized model plus the tensor being quantized."""

    def __init__(self, model: nn.Module, quantization: Quantization) -> None:
        bits = check_quantization(quantization)
        assert bits is not None
        self.model, self.bits = model, bits
        self.targets = quantization_targets(model)
        self.quantized_bytes = 0
        self.source_bytes = 0

    def wants(self, names: list[str]) -> bool:
        return any(name in self.targets for name in names)

    def finish(self, names: list[str], tensor: torch.Tensor) -> None:
        """``tensor`` (all of the tensor named ``names``; tied names share it) is loaded."""
        for name in names:
            if name in self.targets:
                self._quantize(name, tensor)

    def _quantize(self, name: str, tensor: torch.Tensor) -> None:
        owner_name, owner = self.targets.pop(name)
        parent_name, _, leaf = owner_name.rpartition(".")
        parent = self.model.get_submodule(parent_name) if parent_name else self.model
        self.source_bytes += tensor.numel() * tensor.element_size()
        with torch.no_grad():
            if isinstance(owner, nn.Linear):
                packed = quantize_weight(tensor, self.bits)
                quantized = QuantizedLinear(owner.in_features, owner.out_features, packed)
                setattr(parent, leaf, quantized)
            else:
                packed = quantize_stack(tensor, self.bits)
                current = getattr(parent, leaf)
                if not isinstance(current, QuantizedExperts):
                    assert isinstance(owner, RoutedExperts)
                    e, two_i, d = owner.gate_up_proj.shape
                    meta = torch.empty(0, device="meta")
                    current = QuantizedExperts(two_i // 2, meta, meta)
                    setattr(parent, leaf, current)
                source = name.rpartition(".")[2]
                setattr(current, f"{source.removesuffix('_proj')}_qweight", packed)
                # a stack loaded after its sibling was installed on the module now at its path
                current._parameters.pop(source, None)
        self.quantized_bytes += packed.numel()

    def check_done(self) -> None:
        if self.targets:
            raise RuntimeError(f"tensors never quantized: {sorted(self.targets)[:5]}")
        log.info(
            "quantized %.1f MiB of weights to %.1f MiB (int%d)",
            self.source_bytes / 2**20,
            self.quantized_bytes / 2**20,
            self.bits,
        )


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, QuantizedLinear | QuantizedExperts) for m in model.modules())
