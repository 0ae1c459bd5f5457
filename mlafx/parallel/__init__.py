"""Tensor parallelism on CPU: shard the model by heads and intermediate widths across N
worker processes that sum their partial outputs with ``torch.distributed`` (gloo).

- ``sharding``: which weights split along which axis, and the shard model of one rank;
- ``collectives``: the all-reduce op the shard models call (``mlafx_tp::all_reduce_sum``);
- ``worker``: a rank's process (its shard, its compiled step, its caches, its cores);
- ``group``: the driver's side (spawn, hand each step's inputs out, collect rank 0's logits,
  surface a failed worker, shut down);
- ``remote``: ``python -m mlafx.parallel.remote --rank R``, a rank on another machine;
- ``wire``: what crosses the driver <-> rank connections.
"""

from mlafx.parallel.group import TensorParallelError, WorkerGroup, start_workers
from mlafx.parallel.sharding import check_shardable

__all__ = ["TensorParallelError", "WorkerGroup", "check_shardable", "start_workers"]
