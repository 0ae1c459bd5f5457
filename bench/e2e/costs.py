"""What a step should cost: canonical prefill FLOPs and the weight bytes a decode step reads.

Symbols (``ModelConfig``): h = hidden_size, H = heads, P = qk_nope_head_dim,
R = qk_rope_head_dim, V = v_head_dim, Lkv = kv_lora_rank, Lq = q_lora_rank, E = routed
experts, k = experts per token, I = moe_intermediate_size, S = shared experts.

Canonical prefill FLOPs of B fresh sequences of L tokens (matmuls only, 2 per MAC), chosen
so that an implementation's attention path cannot inflate the count:

    per token and layer   q: 2h·H(P+R)  (or 2h·Lq + 2Lq·H(P+R) with a q LoRA)
                          kv_a: 2h(Lkv+R)   kv_b: 2Lkv·H(P+V)   o: 2H·V·h
                          MoE: router 2h·E + (k + S)·3·2h·I   (dense layer: 3·2h·intermediate)
    attention per layer   B · L(L+1)/2 causal pairs · H · 2(P+R+V)   (decompressed MHA)
    lm_head               B sampled positions · 2h·vocab
"""

from __future__ import annotations

import torch

from mlafx.config import ModelConfig


def projection_flops_per_token(cfg: ModelConfig, layer: int) -> float:
    """Matmul FLOPs one token spends in ``layer`` outside attention's pairs."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = 2 * h * heads * cfg.qk_head_dim
    else:
        q = 2 * h * cfg.q_lora_rank + 2 * cfg.q_lora_rank * heads * cfg.qk_head_dim
    kv_a = 2 * h * cfg.latent_width
    kv_b = 2 * cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = 2 * heads * cfg.v_head_dim * h
    if cfg.is_moe_layer(layer):
        experts = cfg.num_experts_per_tok + cfg.n_shared_experts
        mlp = 2 * h * cfg.n_routed_experts + experts * 3 * 2 * h * cfg.moe_intermediate_size
    else:
        mlp = 3 * 2 * h * cfg.intermediate_size
    return float(q + kv_a + kv_b + o + mlp)


def prefill_flops(cfg: ModelConfig, batch: int, length: int) -> float:
    """Canonical FLOPs of prefilling ``batch`` fresh prompts of ``length`` tokens."""
    tokens = batch * length
    pairs = batch * length * (length + 1) / 2
    heads = cfg.num_attention_heads
    attention = pairs * heads * 2 * (cfg.qk_head_dim + cfg.v_head_dim)
    layers = sum(
        tokens * projection_flops_per_token(cfg, layer) + attention
        for layer in range(cfg.num_hidden_layers)
    )
    return layers + batch * 2 * cfg.hidden_size * cfg.vocab_size


def expected_experts_hit(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct routed experts that ``tokens`` tokens select, routing uniformly
    (``E (1 - (1 - k/E)^tokens)``: k for one token, nearly E for a large batch)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def decode_weight_bytes(model: torch.nn.Module, cfg: ModelConfig, batch: int) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads: every weight once,
    except the embedding (``batch`` rows) and the fused routed experts (a leading ``E``
    dimension; only the expected distinct experts hit are read)."""
    hit = expected_experts_hit(cfg, batch) / cfg.n_routed_experts if cfg.n_routed_experts else 0
    total = 0.0
    # quantized weights are uint8 buffers (models/quantized.py); the RoPE table is not read
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, param in tensors:
        if name == "rope_inv_freq":
            continue
        nbytes = param.numel() * param.element_size()
        if name.endswith("embed_tokens.weight"):
            nbytes = batch * param.shape[1] * param.element_size()
        elif ".mlp.experts." in name:
            nbytes *= hit
        total += nbytes
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """mlafx's paged latent cache: one ``Lkv + R`` row per token and layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return cfg.num_hidden_layers * cfg.latent_width * itemsize
