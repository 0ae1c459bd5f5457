"""The all-reduce the shard models call, as a custom op so that it captures, lowers and
compiles like any other op (AOTInductor calls it back through its proxy executor).

``mlafx_tp::all_reduce_sum(x) -> x summed over the ranks of the default process group``
(functional: a new tensor; ``x`` is not modified). Without an initialised process group
the group is this process alone and the sum is ``x`` itself: that is how rank 0 captures,
verifies and compiles its step before the ranks connect (the other ranks then load the
package it built; see ``mlafx.parallel.worker``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mlafx.models.decoder_layer import DecoderLayer
from mlafx.models.longcat import LongcatDecoderLayer


@torch.library.custom_op("mlafx_tp::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@all_reduce_sum.register_fake
def _all_reduce_sum_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def install_all_reduce(model: nn.Module) -> int:
    """Make every decoder layer of a shard model sum its attention and MLP outputs over the
    ranks; returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer | LongcatDecoderLayer)]
    for layer in layers:
        layer.all_reduce = torch.ops.mlafx_tp.all_reduce_sum
    return len(layers)
