"""Load a DeepSeek-V4 checkpoint as DeepSeek ships it (or as transformers names it).

DeepSeek's names (``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{j}.w1.weight``,
``hc_head_fn``, ...) become transformers' in-memory names by the renames of transformers'
conversion mapping (``_RENAMES``), also under ``model.`` (transformers' ``save_pretrained``
writes them so); keys already in transformers' in-memory names load as they are;
``mtp.*`` (the multi-token-prediction layer) is skipped with one log line. A weight with a
sibling ``<m>.scale`` (or ``<m>.weight_scale_inv``) is stored quantized:
- ``F8_E4M3`` with block scales (``quantization_config.weight_block_size``; ue8m0 or float32):
  a linear becomes an ``Fp8Linear`` (the grouped ``o_a_proj`` an ``Fp8GroupedLinear``) over
  the file's bytes, its scales converted to float32 (exact: powers of two);
- ``I8`` / ``U8`` packed e2m1 with ue8m0 scales per 32 (``kernels/fp4_format.py``): routed
  experts (V4's ``expert_dtype: fp4``), stacked into a ``StoredExperts``.
Routed experts are all stored one way or all another (FP4, block FP8 or plain). Everything
else (embeddings, norms, mHC, sinks, compressor and indexer projections, routers: DeepSeek
keeps them bf16 / fp32) is copied into the model, which is built on the meta device so that
memory follows the checkpoint's bytes. The parameters transformers keeps in float32 (norms,
mHC, sinks, position biases, correction biases) stay float32 whatever ``dtype``. Every
problem (a key the model has no place for, a missing tensor, a shape or scale that does not
fit) is reported at once in one ``WeightLoadError``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels.fp4_format import GROUP, ue8m0_to_float
from mlafx.kernels.fp8_format import scale_shape
from mlafx.models.deepseek_v4.attention import GroupedLinear
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlafx.models.deepseek_v4.moe import ClampedExperts
from mlafx.models.deepseek_v4.quantized import (
    Fp8GroupedLinear,
    Fp8KernelLinear,
    StoredExperts,
)
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.packed_int4_checkpoint import replace_module
from mlafx.models.safetensors_file import map_file
from mlafx.models.weights import WeightLoadError, checkpoint_files

logger = logging.getLogger(__name__)

# DeepSeek's names -> transformers' in-memory names, in order (transformers' conversion mapping
# for deepseek_v4); applied to keys that are not already in-memory names.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|down_proj|up_proj)$")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# transformers' _keep_in_fp32_modules_strict for V4
FLOAT32_NAMES = re.compile(
    r"(attn_hc|ffn_hc|hc_head|\.sinks$|position_bias|e_score_correction_bias|q_a_norm|kv_norm|"
    r"input_layernorm|post_attention_layernorm|^model\.norm\.)"
)

Stored = tuple[torch.Tensor, torch.Tensor | None]  # (weight, scale or None)


def in_memory_name(key: str) -> str:
    """transformers' in-memory name of checkpoint key ``key``: DeepSeek's names, the same
    under ``model.`` (what transformers' ``save_pretrained`` writes) and in-memory names (left
    as they are: no rename matches one)."""
    if key.startswith("lm_head."):
        return key
    key = key.removeprefix("model.")
    for pattern, replacement in _RENAMES:
        key = re.sub(pattern, replacement, key)
    return key if key.startswith("lm_head.") else f"model.{key}"


def _block(raw: dict[str, Any]) -> tuple[int, int] | None:
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if quant.get("quant_method") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
        raise WeightLoadError([f"quantization_config {quant} is not DeepSeek's block FP8"])
    bn, bk = quant.get("weight_block_size", (128, 128))
    return int(bn), int(bk)


def _float_scale(scale: torch.Tensor) -> torch.Tensor:
    return (
        scale.float()
        if scale.dtype.is_floating_point and scale.itemsize >= 2
        else ue8m0_to_float(scale)
    )


def _read(model_dir: Path) -> dict[str, Stored]:
    """Every checkpoint tensor under its in-memory name with its scale (MTP skipped)."""
    raw: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(model_dir):
        raw.update(map_file(file))
    scales = {
        key: key.removesuffix(suffix) + ".weight"
        for key in raw
        for suffix in _SCALE_SUFFIXES
        if key.endswith(suffix) and key.removesuffix(suffix) + ".weight" in raw
    }
    owner_scale = {weight: key for key, weight in scales.items()}
    stored, mtp = {}, 0
    for key, tensor in raw.items():
        if key.startswith("mtp.") or ".mtp." in key:
            mtp += 1
        elif key not in scales:
            scale = raw[owner_scale[key]] if key in owner_scale else None
            stored[in_memory_name(key)] = (tensor, scale)
    if mtp:
        logger.info(
            "skipped %d multi-token-prediction (mtp.*) tensors: mlafx does not use them", mtp
        )
    return stored


def _fp8_scale(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    block: tuple[int, int] | None,
    problems: list[str],
) -> torch.Tensor | None:
    """``scale`` in float32 if it fits ``weight`` and the block (else None, a problem noted)."""
    if block is None or scale is None:
        problems.append(f"{name}: FP8 weight but no scale or no quantization_config block")
        return None
    want = scale_shape(weight.shape[0], weight.shape[1], block)
    if tuple(scale.shape) != want:
        problems.append(
            f"{name}: scale shape {tuple(scale.shape)}, want {want} for block {list(block)}"
        )
        return None
    return _float_scale(scale)


def _fp4_check(
    name: str, weight: torch.Tensor, scale: torch.Tensor | None, problems: list[str]
) -> bool:
    if scale is None:
        problems.append(f"{name}: FP4 weight without its scale")
        return False
    rows, cols = weight.shape[-2], 2 * weight.shape[-1]
    want = (rows, -(-cols // GROUP))
    if tuple(scale.shape) != want:
        problems.append(
            f"{name}: FP4 scale shape {tuple(scale.shape)}, want {want} (one per {GROUP})"
        )
        return False
    return True


def load_deepseek_v4(
    model_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> DeepseekV4ForCausalLM:
    """The reference model of the V4 checkpoint in ``model_dir`` (see the module docstring)."""
    model_dir = Path(model_dir)
    raw_config = json.loads((model_dir / "config.json").read_text())
    cfg = DeepseekV4Config.from_hf_dict(raw_config)
    block = _block(raw_config)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    stored = _read(model_dir)
    used: set[str] = set()
    problems: list[str] = []
    _install_quantized(model, cfg, stored, block, dtype, used, problems)
    _copy_the_rest(model, stored, dtype, used, problems)
    problems += [f"{k}: no tensor of the model has this name" for k in sorted(stored.keys() - used)]
    if problems:
        raise WeightLoadError(problems)
    for module in model.modules():
        if isinstance(module, V4RotaryEmbedding):
            module.inv_freq = module.frequencies()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _install_quantized(
    model: nn.Module,
    cfg: DeepseekV4Config,
    stored: dict[str, Stored],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
    used: set[str],
    problems: list[str],
) -> None:
    """Replace every linear stored as FP8 and every stored expert stack."""
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if (
            isinstance(module, nn.Linear | GroupedLinear)
            and key in stored
            and stored[key][1] is not None
        ):
            weight, scale = stored[key]
            used.add(key)
            if weight.dtype != torch.float8_e4m3fn:
                problems.append(f"{key}: scaled weight of dtype {weight.dtype}, want float8_e4m3fn")
                continue
            fscale = _fp8_scale(key, weight, scale, block, problems)
            if fscale is None or block is None:
                continue
            if tuple(weight.shape) != tuple(module.weight.shape):
                problems.append(
                    f"{key}: shape {tuple(weight.shape)}, want {tuple(module.weight.shape)}"
                )
                continue
            replacement: nn.Module = (
                Fp8GroupedLinear(weight, fscale, block, module.groups)
                if isinstance(module, GroupedLinear)
                else Fp8KernelLinear(weight, fscale, block)
            )
            replace_module(model, name, replacement)
        elif isinstance(module, ClampedExperts):
            experts = _expert_parts(name, stored, used)
            if experts:
                problems += _install_experts(model, name, module, cfg, experts, block, dtype)


def _expert_parts(
    name: str, stored: dict[str, Stored], used: set[str]
) -> dict[tuple[int, str], tuple[str, Stored]]:
    parts = {}
    for key in list(stored):
        m = _EXPERT.match(key.removesuffix(".weight"))
        if m and m.group(1) == name and key.endswith(".weight"):
            parts[(int(m.group(2)), _EXPERT_PART.get(m.group(3), "down"))] = (key, stored[key])
            used.add(key)
    return parts


def _install_experts(
    model: nn.Module,
    name: str,
    module: ClampedExperts,
    cfg: DeepseekV4Config,
    parts: dict[tuple[int, str], tuple[str, Stored]],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> list[str]:
    """Per-expert w1 / w2 / w3 (gate / down / up) -> one stack, in the experts' stored form;
    the problems found."""
    e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    missing = [
        f"{name}.{j}.{p}" for j in range(e) for p in ("gate", "up", "down") if (j, p) not in parts
    ]
    extra = [parts[k][0] for k in parts if k[0] >= e]
    if missing or extra:
        return [f"{m}: routed expert part missing" for m in missing] + [
            f"{k}: expert beyond n_routed_experts={e}" for k in extra
        ]
    kinds = {_kind(s[0], s[1]) for _, s in parts.values()}
    if len(kinds) != 1:
        return [f"{name}: experts stored in mixed formats {sorted(kinds)}"]
    (kind,) = kinds
    problems: list[str] = []
    shapes = {"gate": (i, d), "up": (i, d), "down": (d, i)}
    for (_, p), (key, (w, s)) in parts.items():
        want = shapes[p] if kind != "fp4" else (shapes[p][0], shapes[p][1] // 2)
        if tuple(w.shape) != want:
            problems.append(f"{key}: shape {tuple(w.shape)}, want {want} ({kind})")
        elif kind == "fp4":
            _fp4_check(key, w, s, problems)
        elif kind == "fp8":
            _fp8_scale(key, w, s, block, problems)
    if problems:
        return problems

    def part(j: int, p: str, index: int) -> torch.Tensor:
        tensor = parts[(j, p)][1][index]
        assert tensor is not None  # scales exist: the kind is fp4 / fp8
        return tensor

    def stack(part_names: tuple[str, ...], index: int) -> torch.Tensor:
        return torch.stack([torch.cat([part(j, p, index) for p in part_names]) for j in range(e)])

    if kind == "plain":
        module.gate_up_proj = nn.Parameter(stack(("gate", "up"), 0).to(dtype), requires_grad=False)
        module.down_proj = nn.Parameter(stack(("down",), 0).to(dtype), requires_grad=False)
        return []
    gate_up = (stack(("gate", "up"), 0), stack(("gate", "up"), 1))
    down = (stack(("down",), 0), stack(("down",), 1))
    if kind == "fp8":
        gate_up = (gate_up[0], _float_scale(gate_up[1]))
        down = (down[0], _float_scale(down[1]))
    fp8_block = block if kind == "fp8" else None
    replace_module(model, name, StoredExperts(kind, gate_up, down, cfg.swiglu_limit, fp8_block))
    return []


def _kind(weight: torch.Tensor, scale: torch.Tensor | None) -> str:
    if scale is None:
        return "plain"
    return (
        "fp8"
        if weight.dtype == torch.float8_e4m3fn
        else "fp4"
        if weight.dtype in (torch.int8, torch.uint8)
        else f"unknown {weight.dtype}"
    )


def _copy_the_rest(
    model: nn.Module,
    stored: dict[str, Stored],
    dtype: torch.dtype,
    used: set[str],
    problems: list[str],
) -> None:
    """Materialise every tensor still on the meta device from its checkpoint tensor."""
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    targets = [(n, t) for n, t in tensors.items() if t.is_meta and not n.endswith("inv_freq")]
    for name, target in tqdm(targets, desc="weights", unit="tensor", disable=len(targets) < 200):
        if name not in stored:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        source, scale = stored[name]
        used.add(name)
        if scale is not None:
            problems.append(f"{name}: stored quantized, but mlafx keeps this tensor unquantized")
            continue
        if tuple(source.shape) != tuple(target.shape):
            problems.append(f"{name}: shape {tuple(source.shape)}, want {tuple(target.shape)}")
            continue
        if not target.dtype.is_floating_point:
            want = target.dtype
        else:
            want = torch.float32 if FLOAT32_NAMES.search(name) else dtype
        value = source.to(want, copy=True)
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        if isinstance(target, nn.Parameter):
            setattr(owner, leaf, nn.Parameter(value, requires_grad=False))
        else:
            owner._buffers[leaf] = value
