"""The typed record of one matched MLA attention site in a captured step graph."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx


@dataclass(frozen=True)
class MLASite:
    """Nodes of one layer's naive MLA attention (see ``mlafx.models.attention``).

    cache          the layer's paged-cache placeholder [NB, BS, Lkv+R]
    cache_write    ``index_copy_`` of the new latent rows into the flattened cache
    slot_mapping   [T] slots of the new rows
    kv_c, k_pe     [T, Lkv] normalised latent, [T, R] roped key (before the cast and cat)
    gather         ``index_select`` of the key rows the step reads
    kv_b_weight    ``kv_b_proj.weight`` [H*(P+V), Lkv]
    q_nope, q_pe   [T, H, P], [T, H, R] (q_pe roped)
    mask           [T, K] bool, the attention mask; scale the softmax scale
    sdpa           the anchor; output the [T, H*V] node that feeds o_proj
    selected       DSA: the [T, index_topk] int64 positions the mask restricts each query to
                   (an ``mlafx::dsa_indexer_topk`` result or a layer's ``selected`` input);
                   None for dense MLA
    """

    layer: int
    cache: fx.Node
    cache_write: fx.Node
    slot_mapping: fx.Node
    kv_c: fx.Node
    k_pe: fx.Node
    gather: fx.Node
    kv_b_weight: fx.Node
    q_nope: fx.Node
    q_pe: fx.Node
    mask: fx.Node
    scale: float
    sdpa: fx.Node
    output: fx.Node
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    selected: fx.Node | None = None


@dataclass(frozen=True)
class SiteLowering:
    """What ``lower_attention`` made of one site: the ``mlafx::`` ops, in graph order, that
    write the cache, that the absorbed rows run, and that the split rows run (a DSA site runs
    every row through the sparse attention: ``absorbed``, and no split path)."""

    layer: int
    cache_write: tuple[str, ...]
    absorbed: tuple[str, ...]
    split: tuple[str, ...]


@dataclass(frozen=True)
class Refusal:
    """A candidate the matcher looked at and did not rewrite, with the reason."""

    anchor: str  # node name
    reason: str
