"""Load a GGUF file's tensors (``config/gguf_file.py``) into an mlafx model, from their bytes.

Names: llama.cpp's ``deepseek2`` tensors (``_GLOBAL``, ``_PER_LAYER``) map onto the model's
``state_dict`` keys; the fused expert stacks ``blk.N.ffn_{gate,up}_exps`` [E, I, D] fill
``experts.gate_up_proj`` [E, 2I, D] (gate rows first) and ``ffn_down_exps`` ``down_proj``;
``kv_b_proj`` comes from ``attn_kv_b`` [H(P+V), Lkv] or from the split pair ``attn_k_b``
[H, Lkv, P] (stored transposed per head) and ``attn_v_b`` [H, V, Lkv].

How each lands (``GgufPlan``, found from the header before any byte is read):
- **repacked** (lossless, ``kernels/ggml_repack``): a linear (not ``kv_b_proj``) or an expert
  stack stored as Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K becomes a ``QuantizedLinear`` /
  ``QuantizedExperts`` over the same quants and scales: Q4_0 as int4, Q8_0 and Q5_0 as int8,
  Q4_K as k4, Q5_K and Q6_K as k8 (a stack's gate and up rows share one format, so Q4_0 goes
  to int8 or Q4_K to k8 beside a wider sibling; its down rows have their own).
- **mapped**: a tensor stored in the target's dtype (F32 / F16 / BF16) and shape is the
  target, over a private mapping of its bytes (``safetensors_file.map_bytes``): never copied.
- **dequantized** into the target's dtype: everything else (the embedding, norms, router,
  ``kv_b_proj``, and any linear whose type mlafx does not run from its bytes: Q4_1, Q5_1,
  Q2_K, Q3_K, the IQ types, ...) with ``gguf.quants.dequantize`` (llama.cpp's own decoding),
  a chunk of rows at a time. Linears and experts widened this way are logged by name with
  the extra bytes.

Every missing, unexpected or mis-shaped tensor is reported by name in one ``WeightLoadError``
before anything is read.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mlafx.config import ModelConfig
from mlafx.config.gguf_file import GgufFile, GgufTensor
from mlafx.kernels.ggml_repack import (
    GGML_LOSSLESS_FORMATS,
    common_format,
    packed_weight_shape,
    repack_ggml_weight,
    stack_rows,
)
from mlafx.kernels.quant_format import BLOCK_ROWS
from mlafx.models.layers import submodule
from mlafx.models.packed_int4_checkpoint import CheckpointReader, replace_module
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear
from mlafx.models.safetensors_file import map_bytes
from mlafx.models.weights import WeightLoadError

logger = logging.getLogger(__name__)

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# model.layers.{i}.<key> <- blk.{i}.<name>
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GATE_UP = "mlp.experts.gate_up_proj"  # <- ffn_gate_exps + ffn_up_exps
_KV_B = "self_attn.kv_b_proj.weight"  # <- attn_kv_b, or attn_k_b + attn_v_b
_PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_KEPT = ("kv_b_proj",)  # linears kept in the model dtype (models/quantized.py)
_CHUNK_BYTES = 64 << 20  # fp32 scratch per dequantized chunk of rows
_REPACK_ROWS = 256 * BLOCK_ROWS  # rows repacked at once (a multiple of the 16-row blocks)


@dataclass(frozen=True)
class _Fill:
    """A model-dtype target filled from GGUF tensors: one, gate + up (``gate_up``), or the
    split k_b + v_b pair (``kv_b``)."""

    target: str
    sources: tuple[GgufTensor, ...]
    kind: str = "plain"  # "plain" | "gate_up" | "kv_b"


@dataclass(frozen=True)
class _Repack:
    """A linear (``sources`` = its weight) or an expert stack (gate, up, down) repacked into
    ``formats`` (``kernels/ggml_repack``: the linear's, or the stack's gate_up and down)."""

    module: str
    sources: tuple[GgufTensor, ...]
    formats: tuple[str, ...]


@dataclass
class GgufPlan:
    gguf: GgufFile
    fills: list[_Fill] = field(default_factory=list)
    linears: list[_Repack] = field(default_factory=list)
    experts: list[_Repack] = field(default_factory=list)
    widened: list[tuple[str, int]] = field(default_factory=list)  # (tensor, extra bytes)


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(owner), leaf)


def _source_names(cfg: ModelConfig, key: str) -> str | None:
    """The GGUF tensor of a model key (None: not a one-to-one key)."""
    if key in _GLOBAL:
        return _GLOBAL[key]
    if not key.startswith("model.layers."):
        return None
    layer, _, rest = key.removeprefix("model.layers.").partition(".")
    name = _PER_LAYER.get(rest)
    if name is None and rest.endswith(".bias"):  # a linear's bias beside its weight
        weight = _PER_LAYER.get(rest.removesuffix(".bias") + ".weight")
        name = None if weight is None else weight.removesuffix(".weight") + ".bias"
    return None if name is None else f"blk.{layer}.{name}"


def _canonical_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict key -> tensor, one name per tensor (a tied lm_head is the embedding)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen or name.endswith("inv_freq"):
            continue
        seen.add(id(tensor))
        out[name] = tensor
    return out


def _widened_bytes(target_shape: tuple[int, ...], dtype: torch.dtype, src: list[GgufTensor]):
    n = 1
    for d in target_shape:
        n *= d
    return n * dtype.itemsize - sum(s.length for s in src)


def plan_gguf(model: nn.Module, gguf: GgufFile, cfg: ModelConfig) -> GgufPlan:
    """Match the file's tensors to ``model`` (on the meta device) from the header alone; raise
    ``WeightLoadError`` with every problem."""
    planner = _Planner(model, gguf, cfg)
    for key, target in _canonical_targets(model).items():
        if key.endswith("." + _GATE_UP) or key == _GATE_UP:
            planner.expert_stack(key, target)
        elif key.endswith(".mlp.experts.down_proj"):
            continue  # with its gate_up stack
        elif key.endswith(_KV_B):
            planner.kv_b(key, tuple(target.shape))
        else:
            planner.tensor(key, target)
    return planner.finish()


class _Planner:
    """``plan_gguf``'s state: the plan so far, the file's tensors taken, the problems found."""

    def __init__(self, model: nn.Module, gguf: GgufFile, cfg: ModelConfig) -> None:
        self.model, self.cfg = model, cfg
        self.plan = GgufPlan(gguf)
        self.tensors = gguf.tensors
        self.used: set[str] = set()
        self.problems: list[str] = []
        self.modules = dict(model.named_modules())

    def take(self, name: str, shape: tuple[int, ...] | None, what: str) -> GgufTensor | None:
        tensor = self.tensors.get(name)
        if tensor is None:
            self.problems.append(f"{name}: missing from the GGUF file (for {what})")
            return None
        self.used.add(name)
        if shape is not None and tensor.shape != shape:
            self.problems.append(
                f"{name}: shape {list(tensor.shape)} != expected {list(shape)} (for {what})"
            )
            return None
        return tensor

    def expert_stack(self, key: str, target: torch.Tensor) -> None:
        """A layer's routed experts: repacked whole, or dequantized into gate_up and down."""
        layer = key.split(".")[2]
        e, two_i, d = target.shape
        gate = self.take(f"blk.{layer}.ffn_gate_exps.weight", (e, two_i // 2, d), key)
        up = self.take(f"blk.{layer}.ffn_up_exps.weight", (e, two_i // 2, d), key)
        down_key = key.replace("gate_up_proj", "down_proj")
        down_shape = tuple(_lookup(self.model, down_key).shape)
        down = self.take(f"blk.{layer}.ffn_down_exps.weight", down_shape, down_key)
        if gate is None or up is None or down is None:
            return
        formats = _stack_formats((gate, up, down))
        if formats is not None:
            self.plan.experts.append(_Repack(key.rpartition(".")[0], (gate, up, down), formats))
            return
        self.plan.fills.append(_Fill(key, (gate, up), "gate_up"))
        self.plan.fills.append(_Fill(down_key, (down,)))
        for t in (gate, up, down):
            if t.type_name not in _PLAIN:
                self.plan.widened.append((t.name, _widened_bytes(t.shape, target.dtype, [t])))

    def kv_b(self, key: str, shape: tuple[int, ...]) -> None:
        """``kv_b_proj``: llama.cpp's joined tensor, or its newer split k_b / v_b pair."""
        layer = key.split(".")[2]
        joined = f"blk.{layer}.attn_kv_b.weight"
        if joined in self.tensors:
            source = self.take(joined, shape, key)
            if source is not None:
                self.plan.fills.append(_Fill(key, (source,)))
            return
        cfg = self.cfg
        h, p, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        lkv = cfg.kv_lora_rank
        if f"blk.{layer}.attn_k_b.weight" not in self.tensors:
            self.problems.append(
                f"{joined}: missing from the GGUF file, and so is the split pair "
                f"blk.{layer}.attn_k_b.weight / attn_v_b.weight (for {key})"
            )
            return
        k_b = self.take(f"blk.{layer}.attn_k_b.weight", (h, lkv, p), key)
        v_b = self.take(f"blk.{layer}.attn_v_b.weight", (h, v, lkv), key)
        if k_b is not None and v_b is not None:
            self.plan.fills.append(_Fill(key, (k_b, v_b), "kv_b"))

    def tensor(self, key: str, target: torch.Tensor) -> None:
        """Any other tensor: a linear weight in a lossless format is repacked, the rest filled."""
        name = _source_names(self.cfg, key)
        if name is None:
            self.problems.append(f"{key}: mlafx has no GGUF tensor name for this model tensor")
            return
        shape = tuple(target.shape)
        source = self.take(name, shape, key)
        if source is None:
            return
        owner = key.rpartition(".")[0]
        linear = self.modules.get(owner)
        leaf = owner.rpartition(".")[2]
        is_weight = key.endswith(".weight") and isinstance(linear, nn.Linear)
        lossless = GGML_LOSSLESS_FORMATS.get(source.type_name)
        if (
            isinstance(linear, nn.Linear)
            and is_weight
            and leaf not in _KEPT
            and lossless
            and linear.bias is None
            and key != "model.embed_tokens.weight"
        ):
            self.plan.linears.append(_Repack(owner, (source,), lossless[:1]))
            return
        self.plan.fills.append(_Fill(key, (source,)))
        if is_weight and leaf not in _KEPT and source.type_name not in _PLAIN:
            self.plan.widened.append((name, _widened_bytes(shape, target.dtype, [source])))

    def finish(self) -> GgufPlan:
        """The plan, or every problem as one ``WeightLoadError``; logs what is skipped or
        dequantized."""
        extra = sorted(set(self.tensors) - self.used)
        layers = self.cfg.num_hidden_layers
        skipped = [n for n in extra if n.startswith("blk.") and int(n.split(".")[1]) >= layers]
        self.problems += [
            f"{n}: a GGUF tensor the model has no place for" for n in extra if n not in skipped
        ]
        if self.problems:
            raise WeightLoadError(self.problems)
        if skipped:
            logger.info("skipped %d GGUF tensors of layers >= %d", len(skipped), layers)
        widened = self.plan.widened
        if widened:
            logger.warning(
                "GGUF tensors of types mlafx does not run from their own bytes, dequantized to "
                "the model dtype (+%.1f MiB): %s",
                sum(b for _, b in widened) / 2**20,
                ", ".join(f"{n} (+{b / 2**20:.2f} MiB)" for n, b in widened),
            )
        return self.plan


def _stack_formats(parts: tuple[GgufTensor, ...]) -> tuple[str, str] | None:
    """The formats an expert stack (gate, up, down) repacks into without loss: one for the
    gate and up rows together, one for down (None: dequantized)."""
    gate, up, down = parts
    gate_up = common_format([gate.type_name, up.type_name])
    down_format = common_format([down.type_name])
    if gate_up is None or down_format is None:
        return None
    return gate_up, down_format


def install_gguf_modules(model: nn.Module, plan: GgufPlan) -> None:
    """Swap each repacked linear / expert stack for its quantized module (buffers on meta)."""
    for r in plan.linears:
        n, k = r.sources[0].shape
        meta = torch.empty(
            packed_weight_shape(r.formats[0], n, k), dtype=torch.uint8, device="meta"
        )
        replace_module(model, r.module, QuantizedLinear(k, n, meta))
    for r in plan.experts:
        e, i, d = r.sources[0].shape
        gate_up_format, down_format = r.formats
        gate_up = torch.empty(
            (e, *packed_weight_shape(gate_up_format, 2 * i, d)), dtype=torch.uint8, device="meta"
        )
        down = torch.empty(
            (e, *packed_weight_shape(down_format, d, i)), dtype=torch.uint8, device="meta"
        )
        replace_module(model, r.module, QuantizedExperts(i, gate_up, down))


class _Reader(CheckpointReader):
    """Maps GGUF tensors' bytes (the safetensors loaders' reader: one descriptor per file
    kept open for the load)."""

    def raw(self, tensor: GgufTensor) -> torch.Tensor:
        return map_bytes(self.fd(tensor.file), tensor.offset, tensor.length)

    def rows(self, tensor: GgufTensor) -> torch.Tensor:
        """uint8 [..., row bytes]: each innermost row of the tensor."""
        raw = self.raw(tensor)
        return raw.view(
            *tensor.shape[:-1], tensor.length // max(1, tensor.numel // tensor.shape[-1])
        )


def _row_chunks(rows: int, row_elems: int) -> Iterator[slice]:
    step = max(1, _CHUNK_BYTES // (4 * max(1, row_elems)))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def dequantize_into(out: torch.Tensor, reader: _Reader, tensor: GgufTensor) -> None:
    """``out`` (the tensor's shape, any float dtype) <- the tensor's values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if tensor.type_name in _PLAIN:
        raw = reader.raw(tensor)
        if tensor.offset % _PLAIN[tensor.type_name].itemsize:
            raw = raw.clone()
        out.copy_(raw.view(_PLAIN[tensor.type_name]).view(tensor.shape))
        return
    qtype = GGMLQuantizationType[tensor.type_name]
    rows = reader.rows(tensor)
    k = tensor.shape[-1]
    flat_rows = rows.reshape(-1, rows.shape[-1])
    flat_out = out.view(-1, k)
    for chunk in _row_chunks(flat_rows.shape[0], k):
        values = dequantize(flat_rows[chunk].numpy(), qtype)
        flat_out[chunk] = torch.from_numpy(np.ascontiguousarray(values))


def _fill(model: nn.Module, fill: _Fill, reader: _Reader, cfg: ModelConfig) -> None:
    owner_name, _, leaf = fill.target.rpartition(".")
    owner = model.get_submodule(owner_name)
    current = getattr(owner, leaf)
    dtype, shape = current.dtype, tuple(current.shape)
    (first, *_) = fill.sources
    if (
        fill.kind == "plain"
        and _PLAIN.get(first.type_name) == dtype
        and first.offset % dtype.itemsize == 0
    ):
        value = reader.raw(first).view(dtype).view(shape)  # mapped, never copied
    else:
        value = torch.empty(shape, dtype=dtype)
        if fill.kind == "plain":
            dequantize_into(value, reader, first)
        elif fill.kind == "gate_up":
            i = shape[1] // 2
            gate, up = fill.sources
            for e in range(shape[0]):  # expert by expert: bounded scratch
                dequantize_into(value[e, :i], reader, _expert_slice(gate, e))
                dequantize_into(value[e, i:], reader, _expert_slice(up, e))
        else:
            _kv_b_from_split(value, reader, fill.sources, cfg)
    _set(owner, leaf, current, value)


def _expert_slice(stack: GgufTensor, e: int) -> GgufTensor:
    """Expert ``e`` of a stack [E, N, K] as a tensor of its own [N, K] (its byte range)."""
    from dataclasses import replace

    per = stack.length // stack.shape[0]
    return replace(
        stack,
        name=f"{stack.name}[{e}]",
        shape=stack.shape[1:],
        offset=stack.offset + e * per,
        length=per,
    )


def _kv_b_from_split(out: torch.Tensor, reader: _Reader, sources, cfg: ModelConfig) -> None:
    """kv_b_proj [H(P+V), Lkv] <- k_b [H, Lkv, P] (transposed per head) and v_b [H, V, Lkv]."""
    k_b, v_b = sources
    h, p, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    k = torch.empty(k_b.shape, dtype=torch.float32)
    dequantize_into(k, reader, k_b)
    vv = torch.empty(v_b.shape, dtype=torch.float32)
    dequantize_into(vv, reader, v_b)
    heads = out.view(h, p + v, cfg.kv_lora_rank)
    heads[:, :p] = k.transpose(1, 2)
    heads[:, p:] = vv


def _set(owner: nn.Module, leaf: str, current: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(current, nn.Parameter):
        setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
    else:
        owner._buffers[leaf] = value


def _repack_linear(module: QuantizedLinear, reader: _Reader, r: _Repack) -> None:
    """A chunk of rows at a time: the repack's int16 scratch is ~4x the packed bytes, which for
    a vocabulary-sized lm_head would be a transient gigabyte."""
    (source,) = r.sources
    n, k = source.shape
    rows = reader.rows(source)
    out = torch.empty(module.qweight.shape, dtype=torch.uint8)
    for start in range(0, n, _REPACK_ROWS):
        stop = min(n, start + _REPACK_ROWS)
        chunk = repack_ggml_weight(
            source.type_name, rows[start:stop], stop - start, k, r.formats[0]
        )
        out[start // BLOCK_ROWS : start // BLOCK_ROWS + chunk.shape[0]] = chunk
    module.qweight = out


def _repack_experts(module: QuantizedExperts, reader: _Reader, r: _Repack) -> None:
    gate, up, down = r.sources
    e, i, d = gate.shape
    gate_up = torch.empty(module.gate_up_qweight.shape, dtype=torch.uint8)
    down_q = torch.empty(module.down_qweight.shape, dtype=torch.uint8)
    gate_up_format, down_format = r.formats
    for x in range(e):
        if gate.type_name == up.type_name:
            rows = torch.cat(
                [reader.rows(_expert_slice(gate, x)), reader.rows(_expert_slice(up, x))]
            )
            gate_up[x] = repack_ggml_weight(gate.type_name, rows, 2 * i, d, gate_up_format)
        else:  # two types sharing a format: each half's groups as they are, stacked
            halves = [
                repack_ggml_weight(t.type_name, reader.rows(_expert_slice(t, x)), i, d,
                                   gate_up_format)
                for t in (gate, up)
            ]  # fmt: skip
            gate_up[x] = stack_rows(gate_up_format, [(h, i) for h in halves])
        down_rows = reader.rows(_expert_slice(down, x))
        down_q[x] = repack_ggml_weight(down.type_name, down_rows, d, i, down_format)
    module.gate_up_qweight, module.down_qweight = gate_up, down_q


def load_gguf(model: nn.Module, plan: GgufPlan, cfg: ModelConfig, *, progress: bool = True) -> None:
    """Fill every tensor of ``model`` from the file, as planned."""
    total = len(plan.fills) + len(plan.linears) + len(plan.experts)
    bar = tqdm(
        total=total, desc="loading GGUF", unit="tensor", file=sys.stderr, disable=not progress
    )
    reader = _Reader()
    try:
        with torch.no_grad(), bar:
            for r in plan.linears:
                _repack_linear(submodule(model, r.module, QuantizedLinear), reader, r)
                bar.update()
            for r in plan.experts:
                _repack_experts(submodule(model, r.module, QuantizedExperts), reader, r)
                bar.update()
            for f in plan.fills:
                _fill(model, f, reader, cfg)
                bar.update()
    finally:
        reader.close()
