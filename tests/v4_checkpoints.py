"""Tiny DeepSeek-V4 checkpoints in DeepSeek's own layout, written by the tests: DeepSeek's
names (``layers.{i}.attn.wq_a``, ``layers.{i}.ffn.experts.{j}.w1``, ``hc_head_fn``, ...),
dense linears in block FP8 with ue8m0 scales, routed experts in FP4 (e2m1, ue8m0 per 32),
compressor / indexer projections, norms, mHC and embeddings unquantized, an ``mtp.*`` tensor
(skipped by loaders)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from mlafx.kernels.fp4_format import float_to_ue8m0, quantize_fp4
from mlafx.kernels.fp8_format import quantize_fp8

# transformers' in-memory names -> DeepSeek's (the inverse of transformers' conversion
# mapping, written out here on its own; test_deepseek_v4_checkpoint checks it against
# transformers' loader)
_TO_DEEPSEEK = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.norm\.", "norm."),
    (r"^model\.", ""),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.sinks$", ".attn_sink"),
    (r"(compressor)\.kv_norm\.", r"\1.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
]
# DeepSeek keeps these linears unquantized (bf16): the compressors' and the indexer's
_UNQUANTIZED = re.compile(r"compressor\.(indexer\.)?(wkv|wgate)\.|indexer\.weights_proj\.")
BLOCK = (16, 32)
# widths the formats take: K a multiple of 32 (FP4 groups, FP8 blocks of [16, 32])
WIDTHS = dict(
    hidden_size=64,
    q_lora_rank=32,
    head_dim=48,
    qk_rope_head_dim=16,
    o_lora_rank=32,
    index_head_dim=32,
    moe_intermediate_size=32,
)


def deepseek_name(name: str) -> str:
    for pattern, replacement in _TO_DEEPSEEK:
        name = re.sub(pattern, replacement, name)
    return name


def write_deepseek_checkpoint(
    hf_model, path: Path, quantized: bool = True
) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` to ``path`` in DeepSeek's layout; returns what was written."""
    path.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        if name.endswith("inv_freq"):
            continue
        t = tensor.detach().contiguous()
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            layer = deepseek_name(name.rsplit(".", 1)[0])  # layers.{i}.ffn.experts
            for j, w in enumerate(t):
                parts = (
                    {"w1": w[: w.shape[0] // 2], "w3": w[w.shape[0] // 2 :]}
                    if "gate_up" in name
                    else {"w2": w}
                )
                for part, pw in parts.items():
                    key = f"{layer}.{j}.{part}"
                    if quantized:
                        packed, scale = quantize_fp4(pw)
                        out[f"{key}.weight"], out[f"{key}.scale"] = packed, scale
                    else:
                        out[f"{key}.weight"] = pw.to(torch.bfloat16).contiguous()
            continue
        key = deepseek_name(name)
        linear = t.dim() == 2 and name.endswith("proj.weight") and "experts" not in name
        if quantized and linear and not _UNQUANTIZED.search(key):
            _, scale = quantize_fp8(t, BLOCK)
            # ue8m0: round each block's scale up to a power of two, then quantize with it
            pow2 = torch.exp2(torch.ceil(torch.log2(scale)))
            q, _ = _fp8_with_scale(t, pow2)
            out[key], out[key.removesuffix(".weight") + ".scale"] = q, float_to_ue8m0(pow2)
        elif t.is_floating_point() and not any(s in name for s in _FLOAT32_NAMES):
            out[key] = t.to(torch.bfloat16)
        else:
            out[key] = t
    out["mtp.0.emb.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(out, path / "model.safetensors")
    config = hf_model.config.to_dict()
    if quantized:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(BLOCK),
            "expert_dtype": "fp4",
        }
    (path / "config.json").write_text(json.dumps(config))
    return out


def write_dequantized_copy(written: dict[str, torch.Tensor], source: Path, path: Path) -> None:
    """The checkpoint ``written`` to ``source`` with every quantized weight dequantized by
    transformers' own arithmetic (float32), unquantized, to ``path``: the reference's weights."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequantize = Fp8Dequantize(None)._dequantize_one
    plain = {}
    for key, tensor in written.items():
        scale = written.get(key.removesuffix(".weight") + ".scale")
        if not key.endswith(".scale"):
            plain[key] = tensor if scale is None else dequantize(tensor, scale, torch.float32)
    path.mkdir(parents=True)
    save_file(plain, path / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))


# float32 in DeepSeek's files as in transformers (mHC, sinks, position biases, router biases)
_FLOAT32_NAMES = ("_hc.", "hc_head", "sinks", "position_bias", "e_score_correction_bias")


def _fp8_with_scale(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = BLOCK
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
    return (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale
