"""Which compute path a sequence's new tokens take this step: the host's cost rule.

Two exact paths for the same attention (DESIGN.md, "MLA symbols"), both lowered into the
compiled step; the host picks one per sequence per step and says so in the step's index
tensors (``mlafx.models.step``):

- ``ABSORBED``: one ``mla_attention_paged`` pass over the paged latent cache (context and
  new rows alike): per query/key pair and head ``2*Lkv + R`` MACs, nothing decompressed.
- ``SPLIT``: the new tokens attend to each other causally with ``varlen_attention`` over
  their decompressed keys/values (``P + R + V`` MACs per pair and head); if the sequence has
  context, the context half is an absorbed ``mla_attention_paged`` pass over the cached rows
  only, and the two halves are merged by log-sum-exp (``merge_attn_states``).

The rule (DESIGN.md): with C context rows and q new tokens, absorbing beats decompressing the
context iff ``q * (1 + q / (2C)) < threshold``. Charging each path's MACs at its kernel's
efficiency (fraction of the matmul rate), absorbed costs ``q(C + q/2)(2Lkv+R) / e_abs`` and
decompressing ``(C Lkv (P+V) + q(C + q/2)(P+R+V)) / e_mha``, so

    threshold = Lkv (P+V) / (rho (2Lkv + R) - (P + R + V)),   rho = e_mha / e_abs

which is ``Lkv (P+V) / (2Lkv - P - V)`` at ``rho = 1`` (~171 for DeepSeek V2/V3, ~398 for
GLM-4.7-Flash). A fresh prefill (C = 0) is always split; a decode (q = 1 over context) is
always absorbed.
"""

from __future__ import annotations

import enum
import math

from mlafx.config import ModelConfig

# rho = e_mha / e_abs: ``varlen_attention``'s fraction of the bf16 matmul rate over
# ``mla_attention_paged``'s on a 1024-token causal prefill, DeepSeek-V2-Lite shapes (H=16,
# Lkv=512, R=64, P=V=128), bf16, 2 threads, measured on the development machine (2026-11-29,
# bf16 matmul 764 GFLOP/s) with the shapes of bench/kernel_cases/attention.py:
#   mla_attention_paged  16.4% decode B=8 ctx=1024; 16.1% fresh prefill of 256;
#                        19.2% 128 new over 1024 cached; 19.3% fresh prefill of 1024
#   varlen_attention     11.7% causal T=256; 15.3% causal T=1024
# 15.3 / 19.3 = 0.79 (0.73 at 256 tokens). Threshold for V2/V3 at 0.79: ~243 (171 at 1.0).
VARLEN_OVER_PAGED_EFFICIENCY = 0.79


class AttentionPath(enum.Enum):
    ABSORBED = "absorbed"
    SPLIT = "split"


def absorb_threshold(
    cfg: ModelConfig, efficiency_ratio: float = VARLEN_OVER_PAGED_EFFICIENCY
) -> float:
    """The cost rule's threshold for this model (``inf``: absorbing always wins)."""
    lkv, r, p, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    if efficiency_ratio <= 0:
        raise ValueError(f"efficiency_ratio must be positive, got {efficiency_ratio}")
    excess = efficiency_ratio * (2 * lkv + r) - (p + r + v)
    return math.inf if excess <= 0 else lkv * (p + v) / excess


def choose_path(context: int, new_tokens: int, threshold: float) -> AttentionPath:
    """The path of a sequence with ``context`` cached rows and ``new_tokens`` new ones."""
    if new_tokens < 1 or context < 0:
        raise ValueError(f"bad sequence share: context {context}, new tokens {new_tokens}")
    if context == 0:
        return AttentionPath.SPLIT  # nothing to absorb against: causal MHA over the new rows
    if new_tokens == 1:
        return AttentionPath.ABSORBED  # a decode
    cost = new_tokens * (1 + new_tokens / (2 * context))
    return AttentionPath.ABSORBED if cost < threshold else AttentionPath.SPLIT
