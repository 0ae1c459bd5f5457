"""Serve a ``transformers`` MLA model object (DeepSeek-V2/V3 family, GLM-4.7-Flash, MiniCPM3,
LongCat-Flash, Kimi K2.5's language model) with mlafx's own model.

mlafx's plain model keeps transformers' in-memory parameter names and layouts (experts
fused as ``gate_up_proj``/``down_proj``), so the object's tensors are adopted as they are —
shared, not copied — and the usual capture -> MLA passes -> compile pipeline runs on
mlafx's model. Only the routers' weights are copied (mlafx scores routing in fp32), and
RoPE tables are recomputed from the config.

Why not capture transformers' own forward: its attention assembles the key with
``new_empty`` and slice copies instead of a concatenation, and its KV cache is a Python
object updated outside any graph, so the SDPA-anchored matcher refuses every site of a
captured transformers model (``tests/test_from_transformers.py`` pins the reason it gives).
"""

from __future__ import annotations

from typing import Any

import torch

from mlafx.config import ModelConfig
from mlafx.models.checkpoint_keys import text_model_key
from mlafx.models.deepseek import MLAForCausalLM


def model_from_transformers(
    hf_model: torch.nn.Module, hf_overrides: dict[str, Any] | None = None
) -> MLAForCausalLM:
    """An eval-mode mlafx model whose weights are ``hf_model``'s tensors (same dtype)."""
    config = getattr(hf_model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(
            f"expected a transformers model with a .config, got {type(hf_model).__name__}"
        )
    cfg = ModelConfig.from_hf_dict(config.to_dict(), hf_overrides)
    # a multimodal wrapper's (Kimi K2.5's) language model by the text model's names; its
    # vision tower and projector are left out
    state = {}
    for name, tensor in hf_model.state_dict().items():
        text_name = text_model_key(name)
        if text_name is not None:
            state[text_name] = tensor
    with torch.device("meta"):
        model = MLAForCausalLM(cfg)
    wanted = set(model.state_dict())
    missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if missing or unexpected:
        raise ValueError(
            f"{type(hf_model).__name__} does not match mlafx's {cfg.model_type} model: "
            f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in state.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name} is on {tensor.device}; mlafx serves on the CPU")
    model.load_state_dict(state, strict=True, assign=True)
    model.keep_float32()  # copies only the (small) router and indexer head weights
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.reset_rope()  # the only non-persistent buffer, still on the meta device
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"model_from_transformers left tensors unset: {left[:5]}")
    return model.eval().requires_grad_(False)
