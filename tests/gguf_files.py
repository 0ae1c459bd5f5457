"""GGUF files written by the tests themselves, the way llama.cpp's ``convert_hf_to_gguf.py``
(``DeepseekV2Model``, arch ``deepseek2``) writes them: its metadata keys, tensor names, fused
expert stacks and either kv_b layout ("split": ``attn_k_b`` transposed per head + ``attn_v_b``,
as the converter does now; "joined": the older single ``attn_kv_b``).

Tensor types: ``types(gguf_name, torch_shape)`` picks each tensor's ggml type (F32 where a
block type does not divide the row, as llama.cpp's quantizer falls back). Q8_0/Q4_0/Q4_1/
Q5_0/Q5_1 are quantized with ``gguf.quants.quantize``; the K-quants, which the ``gguf``
package cannot quantize, are random valid blocks (sane float16 scales, random quants). Every
tensor is then read back with ``gguf.quants.dequantize`` into the HF state dict the reference
model runs: transformers on exactly the weights the file holds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    TokenType,
)
from gguf.quants import dequantize, quantize

Q = GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# byte offset of the float16 super-block scale(s) in each K-quant block, and a sane size
_K_SCALES = {Q.Q4_K: ((0, 2), 3e-4), Q.Q5_K: ((0, 2), 2e-4), Q.Q6_K: ((208,), 6e-5)}


def random_k_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a K-quant type for a tensor of ``shape`` (rows of shape[-1])."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows = int(np.prod(shape[:-1]))
    blocks = rng.integers(0, 256, size=(rows, shape[-1] // block, size), dtype=np.uint8)
    offsets, scale = _K_SCALES[qtype]
    for offset in offsets:
        d = (rng.uniform(0.5, 1.5, size=blocks.shape[:2]) * scale).astype(np.float16)
        blocks[..., offset : offset + 2] = d.view(np.uint8).reshape(*d.shape, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block * size)


def encode(tensor: torch.Tensor, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    values = tensor.detach().float().numpy()
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in K_QUANTS:
        return random_k_blocks(values.shape, qtype, rng)
    return quantize(values, qtype)


def decode(data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    if qtype in (Q.F32, Q.F16):
        return torch.from_numpy(np.array(data, dtype=np.float32))
    return torch.from_numpy(np.array(dequantize(data, qtype))).reshape(shape)


def f32_only(name: str, shape: tuple[int, ...]) -> Q:
    return Q.F32


def block_type(qtype: Q, *, skip: tuple[str, ...] = ()) -> Callable[[str, tuple[int, ...]], Q]:
    """``qtype`` for every matrix whose rows it divides (not norms, router, ``skip``), else F32."""

    def pick(name: str, shape: tuple[int, ...]) -> Q:
        if (
            len(shape) < 2
            or "norm" in name
            or "ffn_gate_inp" in name
            or any(s in name for s in skip)
        ):
            return Q.F32
        return qtype if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F32

    return pick


def _metadata(writer: GGUFWriter, cfg, kv_b: str) -> None:
    c = cfg
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(1 if kv_b == "split" else c.num_attention_heads)
    writer.add_rope_freq_base(float(c.rope_parameters.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_expert_used_count(c.num_experts_per_tok)
    n_group = getattr(c, "n_group", None) or 1
    writer.add_expert_group_count(n_group)
    writer.add_expert_group_used_count(getattr(c, "topk_group", None) or n_group)
    # GLM-4.7-Flash lists its layers' MLP types; llama.cpp counts the leading dense ones
    types = getattr(c, "mlp_layer_types", None)
    leading = c.first_k_dense_replace if types is None else types.index("sparse")
    writer.add_leading_dense_block_count(leading)
    writer.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    if kv_b == "split":
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(qk_head)
        writer.add_value_length_mla(c.v_head_dim)
    else:
        writer.add_key_length(qk_head)
        writer.add_value_length(c.v_head_dim)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_shared_count(c.n_shared_experts or 0)
    writer.add_expert_weights_scale(float(c.routed_scaling_factor))
    if c.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    scoring = getattr(c, "scoring_func", None) or (
        "softmax" if c.model_type == "deepseek_v2" else "sigmoid"
    )
    gating = ExpertGatingFuncType.SOFTMAX if scoring == "softmax" else ExpertGatingFuncType.SIGMOID
    writer.add_expert_gating_func(gating)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)


_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _gguf_tensors(
    state: dict[str, torch.Tensor], cfg, kv_b: str
) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF name -> (the HF key it came from, or a marker; the torch tensor)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key in _NAMES:
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            out[_NAMES[key]] = (key, value)
            continue
        layer, _, rest = key.removeprefix("model.layers.").partition(".")
        module, _, leaf = rest.rpartition(".")
        if rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = (key, value)
        elif rest == "mlp.experts.gate_up_proj":
            i = value.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = (key + "#gate", value[:, :i])
            out[f"blk.{layer}.ffn_up_exps.weight"] = (key + "#up", value[:, i:])
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = (key, value)
        elif module == "self_attn.kv_b_proj":
            if kv_b == "joined":
                out[f"blk.{layer}.attn_kv_b.weight"] = (key, value)
                continue
            h, p, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            heads = value.view(h, p + v, value.shape[-1])
            out[f"blk.{layer}.attn_k_b.weight"] = (
                key + "#k_b",
                heads[:, :p].transpose(1, 2).contiguous(),
            )
            out[f"blk.{layer}.attn_v_b.weight"] = (key + "#v_b", heads[:, p:].contiguous())
        elif module in _LAYER_NAMES:
            out[f"blk.{layer}.{_LAYER_NAMES[module]}.{leaf}"] = (key, value)
        else:
            raise KeyError(f"no GGUF name for {key}")
    return out


def write_tokenizer(writer: GGUFWriter, tokenizer, pre: str, chat_template: str | None) -> None:
    """An HF ``tokenizers`` byte-level BPE as ``tokenizer.ggml.*`` (the converter's
    ``_set_vocab_gpt2``): tokens by id, CONTROL for special added tokens, USER_DEFINED for
    other added ones, merges as "a b"."""
    import json

    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    types = [TokenType.NORMAL] * len(tokens)
    for added in spec["added_tokens"]:
        types[added["id"]] = TokenType.CONTROL if added["special"] else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_token_merges(merges)
    if chat_template is not None:
        writer.add_chat_template(chat_template)


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    *,
    kv_b: str = "split",
    types: Callable[[str, tuple[int, ...]], Q] = f32_only,
    seed: int = 0,
    tokenizer=None,
    pre: str = "deepseek-v3",
    chat_template: str | None = None,
    special_ids: dict[str, int] | None = None,
    add_bos: bool | None = None,
    split_max_tensors: int = 0,
) -> dict[str, torch.Tensor]:
    """Write ``hf_model`` as a GGUF file at ``path``; return the HF state dict of what the
    file holds (every tensor dequantized), for a transformers reference."""
    cfg = hf_model.config
    state = {k: v for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, "deepseek2", split_max_tensors=split_max_tensors)
    writer.add_name("mlafx test model")
    _metadata(writer, cfg, kv_b)
    if tokenizer is not None:
        write_tokenizer(writer, tokenizer, pre, chat_template)
    for kind, token_id in (special_ids or {}).items():
        getattr(writer, f"add_{kind}_token_id")(token_id)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    decoded: dict[str, torch.Tensor] = {}
    for name, (key, value) in _gguf_tensors(state, cfg, kv_b).items():
        qtype = types(name, tuple(value.shape))
        data = encode(value, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        decoded[key] = decode(data, qtype, tuple(value.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _hf_state(decoded, state, cfg)


def _hf_state(
    decoded: dict[str, torch.Tensor], state: dict[str, torch.Tensor], cfg
) -> dict[str, torch.Tensor]:
    out = {}
    for key in state:
        if key in decoded:
            out[key] = decoded[key]
        elif key.endswith("gate_up_proj"):
            out[key] = torch.cat([decoded[key + "#gate"], decoded[key + "#up"]], dim=1)
        elif key.endswith("kv_b_proj.weight"):
            k_b, v_b = decoded[key + "#k_b"], decoded[key + "#v_b"]
            out[key] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(state[key].shape)
        elif key == "lm_head.weight":
            out[key] = decoded["model.embed_tokens.weight"]
    return out
