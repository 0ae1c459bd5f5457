"""Capture the step function as an FX graph with ``torch.export`` (non-strict): the whole step
(``capture_step``: inspect, the pt2 and ONNX artifacts) or one decoder layer of it
(``capture_layer``: what the compiled engine runs, once per layer kind).

Its default pre-dispatch ATen IR keeps ``scaled_dot_product_attention``, ``linear`` and the
in-place ``index_copy_`` into the cache as single nodes, which is what the MLA matcher in
``mlafx.passes`` anchors on. Exactly the step's extents are dynamic (named ``Dim``s):

    T  new tokens       input_ids, positions, slot_mapping, query_seq_ids
    B  sequences        block_table rows, kv_lens; B+1 for query_start_loc
    M  block-table columns (every block table)
    K  key rows read    key_seq_ids, key_positions (0 for a step that does not read them)
    S  sampled tokens   logits_indices
    NB cache blocks     every cache's first dim
    TA, BA  absorbed sub-batch rows, sequences    (absorbed_*)
    TS, BS  split sub-batch rows, sequences       (split_*)
    TC, BC  context-half rows, sequences          (context_*)
The block size (the caches' second dim) and all model dimensions are static. Tracing runs
under ``backed_size_oblivious`` so that sizes 0 and 1 are not specialised away (a decode
step has T = 1).

Routed experts dispatch on data (which expert each token picked), which does not trace; the
capture records each ``RoutedExperts`` call as one ``mlafx::moe_experts`` node instead (and
the quantized modules as their kernels: ``models/quantized.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from mlafx.models.attention_path import AttentionPath
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.dsa import DsaDecoderLayer, Indexer
from mlafx.models.fp8 import Fp8Experts, Fp8Linear
from mlafx.models.moe import RoutedExperts
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear
from mlafx.models.rope import rope_cos_sin
from mlafx.models.step import (
    SequenceSpan,
    StepInputs,
    StepMetadata,
    build_step_inputs,
    key_slots_and_mask,
)

# The sample step: (context rows, new tokens, path, draws a token) per sequence. Every kind of
# row on both paths, with the path fixed (not left to the cost rule): an absorbed prefill
# with context, absorbed decodes, an absorbed fresh prefill, split prefills with context, a
# split fresh prefill, and a non-final prompt chunk (draws no token). Each dynamic extent
# gets a distinct size >= 2, so none is specialised or tied to another while tracing.
_ABSORBED, _SPLIT = AttentionPath.ABSORBED, AttentionPath.SPLIT
SAMPLE_SEQUENCES = (
    (3, 4, _ABSORBED, True),
    (6, 3, _SPLIT, True),
    (0, 6, _SPLIT, True),
    (10, 1, _ABSORBED, True),
    (2, 2, _SPLIT, False),
    (5, 1, _ABSORBED, True),
    (0, 2, _ABSORBED, True),
)


def _sample_blocks(seq: int, num_tokens: int, block_size: int) -> list[int]:
    """Blocks interleaved across the sample's sequences (never contiguous; block 0 unused)."""
    return [1 + seq + len(SAMPLE_SEQUENCES) * i for i in range(-(-num_tokens // block_size))]


def sample_step_inputs(block_size: int, vocab_size: int) -> StepInputs:
    """A small but general step to trace and verify with (``SAMPLE_SEQUENCES``)."""
    spans = [
        SequenceSpan(
            [(7 * seq + 3 * i + 1) % vocab_size for i in range(new)],
            context,
            context + new,
            _sample_blocks(seq, context + new, block_size),
            sample=sample,
            path=path,
        )
        for seq, (context, new, path, sample) in enumerate(SAMPLE_SEQUENCES)
    ]
    # with the key rows: the capture traces, and verify runs, the reference model on it
    return build_step_inputs(spans, block_size, key_rows=True)


def num_sample_blocks(block_size: int) -> int:
    """Cache blocks the sample step addresses (its block ids are below this)."""
    longest = max(context + new for context, new, _, _ in SAMPLE_SEQUENCES)
    return 1 + len(SAMPLE_SEQUENCES) * -(-longest // block_size)


def _meta_dynamic_shapes(t: Dim) -> list[dict[int, object]]:
    """The ``StepMetadata`` fields' dynamic extents, in declaration order."""
    b, m, k = (Dim(n) for n in ("B", "M", "K"))
    ta, ba, ts, bs, tc, bc = (Dim(n) for n in ("TA", "BA", "TS", "BS", "TC", "BC"))
    return [
        {0: t},  # slot_mapping
        {0: t},  # query_seq_ids
        {0: b, 1: m},  # block_table
        {0: b},  # kv_lens
        {0: b + 1},  # query_start_loc
        {0: k},  # key_seq_ids
        {0: k},  # key_positions
        {0: ta},  # absorbed_token_index
        {0: ba, 1: m},  # absorbed_block_table
        {0: ba},  # absorbed_kv_lens
        {0: ba + 1},  # absorbed_query_start_loc
        {0: ts},  # split_token_index
        {0: bs + 1},  # split_cu_seqlens
        {0: tc},  # context_split_rows
        {0: bc, 1: m},  # context_block_table
        {0: bc},  # context_lens
        {0: bc + 1},  # context_query_start_loc
    ]


def step_dynamic_shapes(num_layers: int) -> dict[str, object]:
    t, s, nb = Dim("T"), Dim("S"), Dim("NB")
    return {
        "input_ids": {0: t},
        "positions": {0: t},
        "caches": [{0: nb}] * num_layers,
        "meta": _meta_dynamic_shapes(t),
        "logits_indices": {0: s},
    }


def layer_dynamic_shapes(num_caches: int, *, selection: bool = False) -> dict[str, object]:
    """:class:`LayerStep`'s inputs: the step's extents, the layer's caches (and the selection
    a :class:`SharedSelectionLayerStep` takes)."""
    t = Dim("T")
    return {
        "x": {0: t},
        "positions": {0: t},
        "cos": {0: t},
        "sin": {0: t},
        "caches": [{0: Dim("NB")}] * num_caches,
        "meta": _meta_dynamic_shapes(t),
        **({"selected": {0: t}} if selection else {}),
    }


class LayerStep(nn.Module):
    """One decoder layer as a step function, the unit the compiler captures once per layer
    kind (layers of one kind share the graph and each runs it with its own weights):

        (x [T, D], positions [T], cos, sin [T, R/2] float32,
         caches: the layer's (``ModelConfig.layer_cache_widths``, mutated), meta) -> x [T, D]

    A DSA layer that runs its indexer returns ``(x, selected [T, index_topk] int64)``; a
    "shared" one takes the selection (:class:`SharedSelectionLayerStep`). The key slots and
    the mask the reference attention reads are derived from ``meta`` here, as the whole
    model's forward derives them once per step (dead code once lowered)."""

    def __init__(self, layer: nn.Module) -> None:  # a DecoderLayer, Longcat- or DsaDecoderLayer
        super().__init__()
        self.layer = layer

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._run(x, positions, cos, sin, caches, meta, None)

    def _run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        selected: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        key_slots, mask = key_slots_and_mask(meta, positions, caches[0].shape[1])
        if not isinstance(self.layer, DsaDecoderLayer):
            return self.layer(x, cos, sin, caches, meta.slot_mapping, key_slots, mask)
        x, selected = self.layer(
            x, cos, sin, caches, meta.slot_mapping, key_slots, mask, meta, positions, selected
        )
        return x if self.layer.self_attn.indexer is None else (x, selected)


class SharedSelectionLayerStep(LayerStep):
    """A GLM-5 "shared" DSA layer: ``LayerStep``'s inputs plus the last full layer's
    ``selected [T, index_topk]`` int64; returns x."""

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        selected: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._run(x, positions, cos, sin, caches, meta, selected)


def takes_selection(layer: nn.Module) -> bool:
    """Whether ``layer`` is a DSA layer without its own indexer (it reads another's)."""
    return isinstance(layer, DsaDecoderLayer) and layer.self_attn.indexer is None


def layer_step(layer: nn.Module) -> LayerStep:
    """The step function of decoder layer ``layer`` (its selection input if it takes one)."""
    return SharedSelectionLayerStep(layer) if takes_selection(layer) else LayerStep(layer)


LAYER_PREFIX = "layer."  # LayerStep's parameter names are the decoder layer's, behind this


@dataclass(frozen=True)
class LayerSample:
    """A sample input of :class:`LayerStep` (the sample step's rows, random hidden states)."""

    step: StepInputs
    x: torch.Tensor  # [T, D] model dtype
    cos: torch.Tensor
    sin: torch.Tensor
    caches: list[torch.Tensor]  # zeroed, the layer's, just large enough for the sample
    # a shared DSA layer's input: every visible position (at most index_topk) of each query
    selected: torch.Tensor | None = None

    @property
    def meta(self) -> StepMetadata:
        return self.step.meta

    def args(self, caches: list[torch.Tensor]) -> tuple:
        """:class:`LayerStep`'s arguments around the layer's caches."""
        args = (self.x, self.step.positions, self.cos, self.sin, list(caches), self.step.meta)
        return args if self.selected is None else (*args, self.selected)


def sample_layer(
    model: MLAForCausalLM, block_size: int, layer: int = 0, seed: int = 0
) -> LayerSample:
    """The sample input of decoder layer ``layer`` (its caches; its selection if it takes
    one)."""
    cfg = model.config
    dtype = model.dtype
    step = sample_step_inputs(block_size, cfg.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(len(step.positions), cfg.hidden_size, generator=generator).to(dtype)
    cos, sin = rope_cos_sin(step.positions, model.rope_inv_freq, model.rope_scale)
    caches = [
        torch.zeros(num_sample_blocks(block_size), block_size, width, dtype=dtype)
        for width in cfg.layer_cache_widths(layer)
    ]
    selected = None
    if takes_selection(model.model.layers[layer]):
        first = torch.arange(cfg.index_topk)[None, :]
        selected = torch.where(first <= step.positions[:, None], first, -1)
    return LayerSample(step, x, cos, sin, caches, selected)


def capture_layer(model: MLAForCausalLM, layer: int, block_size: int) -> ExportedProgram:
    """Decoder layer ``layer`` of ``model`` as a :class:`LayerStep` ExportedProgram (its
    weights are the layer's own tensors: nothing is copied)."""
    sample = sample_layer(model, block_size, layer)
    module = layer_step(model.model.layers[layer])
    dynamic = layer_dynamic_shapes(len(sample.caches), selection=sample.selected is not None)
    return _export(module, sample.args(sample.caches), dynamic)


def size_oblivious() -> contextlib.AbstractContextManager[None]:
    """torch.fx's ``backed_size_oblivious`` on for the block: every export of a step runs
    under it, so that sizes 0 and 1 are not specialised away."""
    from torch.fx.experimental import _config

    return cast(Any, _config).patch(backed_size_oblivious=True)  # installed at import time


def _export(module: nn.Module, args: tuple, dynamic_shapes: Any) -> ExportedProgram:
    """Non-strict export under ``backed_size_oblivious``, routed experts and quantized linears
    as custom ops."""
    with kernels_as_custom_ops(), size_oblivious(), torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)


def _experts_forward(self, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
    return torch.ops.mlafx.moe_experts(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj)


def _quantized_experts_forward(self, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
    return torch.ops.mlafx.moe_experts_quantized(
        x, topk_ids, topk_weights, self.gate_up_qweight, self.down_qweight, self.intermediate_size
    )


def _quantized_linear_forward(self, x):  # type: ignore[no-untyped-def]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mlafx.linear_quantized(rows, self.qweight, self.out_features, None)
    return out.reshape(*x.shape[:-1], self.out_features)


def _fp8_experts_forward(self, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
    return torch.ops.mlafx.moe_experts_fp8(
        x, topk_ids, topk_weights, self.gate_up_weight, self.gate_up_scale, self.down_weight,
        self.down_scale, *self.block,
    )  # fmt: skip


def _indexer_select(self, q, k, weights, cache, key_slots, mask, meta, positions):  # type: ignore[no-untyped-def]  # noqa: E501
    rope, dim = self.cfg.qk_rope_head_dim, self.cfg.index_head_dim
    rot, rest = k.split([rope, dim - rope], dim=-1)
    torch.ops.mlafx.write_latent_cache(rot, rest, cache, meta.slot_mapping)
    return torch.ops.mlafx.dsa_indexer_topk(
        q, weights * dim**-0.5, cache, meta.block_table, meta.kv_lens, meta.query_start_loc,
        positions, self.cfg.index_topk,
    )  # fmt: skip


def _fp8_linear_forward(self, x):  # type: ignore[no-untyped-def]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mlafx.linear_fp8(rows, self.weight, self.weight_scale_inv, *self.block, None)
    return out.reshape(*x.shape[:-1], self.out_features)


@contextlib.contextmanager
def kernels_as_custom_ops() -> Iterator[None]:
    """Within this block every ``RoutedExperts`` runs ``mlafx::moe_experts`` (its data-dependent
    dispatch does not trace), the quantized modules run their kernels
    (``mlafx::linear_quantized``, ``mlafx::moe_experts_quantized``, ``mlafx::linear_fp8``,
    ``mlafx::moe_experts_fp8``: the same semantics as their eager reference, which dequantizes
    whole weights), and a DSA ``Indexer`` writes its keys with ``mlafx::write_latent_cache`` and
    selects with ``mlafx::dsa_indexer_topk`` over the paged indexer cache (a data-dependent
    top-k the reference computes over every key row)."""
    import mlafx.kernels  # noqa: F401  (registers the ops and their fakes)

    with methods_replaced(
        (RoutedExperts, "forward", _experts_forward),
        (QuantizedExperts, "forward", _quantized_experts_forward),
        (QuantizedLinear, "forward", _quantized_linear_forward),
        (Fp8Experts, "forward", _fp8_experts_forward),
        (Fp8Linear, "forward", _fp8_linear_forward),
        (Indexer, "select", _indexer_select),
    ):
        yield


@contextlib.contextmanager
def methods_replaced(*replacements: tuple[type, str, Callable[..., Any]]) -> Iterator[None]:
    """Within this block each ``(class, name, method)``'s method is ``method``; restored after
    (also on error)."""
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in replacements]
    for cls, name, method in replacements:
        setattr(cls, name, method)
    try:
        yield
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)


def sample_step(model: MLAForCausalLM, block_size: int) -> tuple[StepInputs, list[torch.Tensor]]:
    """The sample step's inputs and zeroed caches just large enough for it (model dtype)."""
    cfg = model.config
    dtype = model.dtype
    caches = [
        torch.zeros(num_sample_blocks(block_size), block_size, width, dtype=dtype)
        for width in cfg.cache_widths
    ]
    return sample_step_inputs(block_size, cfg.vocab_size), caches


def capture_step(model: MLAForCausalLM, block_size: int) -> ExportedProgram:
    """The model's step as an ExportedProgram (pre-dispatch ATen IR, dynamic extents)."""
    sample, caches = sample_step(model, block_size)
    dynamic = step_dynamic_shapes(model.config.num_caches)
    return _export(model, sample.args(caches), dynamic)
