"""Which compute path a sequence's new tokens take this step: the host's cost rule.

Two exact paths for the same attention (DESIGN.md, "MLA symbols"), both lowered into the
compiled step; the host picks one per sequence per step and says so in the step's index
tensors (``mlafx.models.step``):

- ``ABSORBED``: one ``mla_attention_paged`` pass over the paged latent cache (context and
  new rows alike): per query/key pair and head ``2*Lkv + R`` MACs, nothing decompressed.
- ``SPLIT``: the new tokens attend to each other causally with ``varlen_attention`` over
  their decompressed keys/values (``P + R + V`` MACs per pair and head, after ``Lkv*(P+V)``
  per new token and head to decompress them with ``kv_b_proj``); if the sequence has
  context, the context half is an absorbed ``mla_attention_paged`` pass over the cached rows
  only, and the two halves are merged by log-sum-exp (``merge_attn_states``).

With context C > 0 both paths pay the same for it (its absorbed pass, the queries' absorption
``q_nope @ W_UK`` and the up-projection by ``W_UV``), so they differ only on the new tokens'
``q(q+1)/2`` causal pairs and their decompression, whatever C is. With ``t_abs``, ``t_mha``
and ``t_gemm`` the seconds per MAC of the three kernels on this host (``PathCosts``,
measured by ``mlafx.runtime.attention_costs``), the split pays iff

    (q+1)/2 * ((2Lkv+R) t_abs - (P+R+V) t_mha) > Lkv (P+V) t_gemm

that is iff ``q`` exceeds ``split_threshold``. At equal costs per MAC that is ``q > ~340``
for DeepSeek V2/V3 (Lkv 512, R 64, P = V = 128); where the decompression GEMM runs nearer
the matmul rate than the attention kernels do, fewer. A decode (q = 1 over context) is
absorbed. A fresh prefill (C = 0) decompresses its rows instead of absorbing its queries and
up-projecting its output (the same ``Lkv (P+V)`` MACs per token and head), so it is split
whenever a decompressed pair is the cheaper one (a finite threshold).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from mlafx.config import ModelConfig


class AttentionPath(enum.Enum):
    ABSORBED = "absorbed"
    SPLIT = "split"


@dataclass(frozen=True)
class PathCosts:
    """Seconds per multiply-accumulate of each kernel the paths run, at the model's shapes:
    ``absorbed`` (``mla_attention_paged``), ``decompressed`` (``varlen_attention``) and
    ``gemm`` (the ``kv_b_proj`` product that decompresses the new rows)."""

    absorbed: float
    decompressed: float
    gemm: float

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"PathCosts.{name} must be a positive time per MAC, got {value}")


def split_threshold(cfg: ModelConfig, costs: PathCosts) -> float:
    """The number of new tokens above which the split beats one absorbed pass (``inf``: the
    absorbed pass always wins)."""
    lkv, r, p, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    saved_per_pair = (2 * lkv + r) * costs.absorbed - (p + r + v) * costs.decompressed
    if saved_per_pair <= 0:
        return math.inf
    return 2 * lkv * (p + v) * costs.gemm / saved_per_pair - 1


def choose_path(context: int, new_tokens: int, threshold: float) -> AttentionPath:
    """The path of a sequence with ``context`` cached rows and ``new_tokens`` new ones, given
    ``split_threshold``."""
    if new_tokens < 1 or context < 0:
        raise ValueError(f"bad sequence share: context {context}, new tokens {new_tokens}")
    if context == 0:  # decompressing the rows replaces absorbing the queries
        return AttentionPath.SPLIT if math.isfinite(threshold) else AttentionPath.ABSORBED
    if new_tokens == 1:
        return AttentionPath.ABSORBED  # a decode: no pair to save on
    return AttentionPath.SPLIT if new_tokens > threshold else AttentionPath.ABSORBED
