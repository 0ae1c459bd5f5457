"""The driver's side of tensor parallelism: N local worker processes (ranks 0..N-1) and
the step callable the engine runs.

The driver is not a rank: it never waits inside a collective, so it can always notice a
failed worker. Each step it sends the step's inputs to every rank over that rank's pipe and
waits for all of them (``multiprocessing.connection.wait`` on the pipes and the process
sentinels): rank 0 answers with the logits, the others with an acknowledgement. A worker
that raises (it sends its traceback) or dies (its sentinel fires) fails the group: the other
workers are terminated (a rank stuck in an all-reduce with a dead peer would otherwise wait
for the collective timeout) and this and every later step raise ``TensorParallelError``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from mlafx.config import ModelConfig
from mlafx.models.step import StepMetadata
from mlafx.parallel.wire import dumps, loads, step_to_wire, tensor_from_wire
from mlafx.parallel.worker import WorkerSpec, worker_main

log = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker failed (raised, or its process died); the group is gone."""


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def core_slices(world_size: int) -> list[tuple[tuple[int, ...], int]]:
    """(cores to pin, threads) per rank: the CPUs this process may use, split evenly; with
    fewer CPUs than ranks, no pinning and one thread each."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // world_size
    if per_rank == 0:
        return [((), 1)] * world_size
    return [(tuple(cores[r * per_rank : (r + 1) * per_rank]), per_rank) for r in range(world_size)]


class _Workers:
    """The processes and pipes; ``shutdown`` is also the finaliser run at interpreter exit,
    so it must not refer to the ``WorkerGroup``."""

    def __init__(self) -> None:
        self.processes: list[Any] = []
        self.conns: list[Connection] = []

    def shutdown(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns:
                try:
                    conn.send_bytes(dumps(("close", None)))
                except OSError:
                    pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []


class WorkerGroup:
    """Start ``world_size`` ranks from ``spec`` (its ``rank``, rendezvous and cores are
    filled in per rank), build and compile their shards, connect them; then callable as
    the engine's step: ``(input_ids, positions, caches, meta, logits_indices) -> logits``
    (rank 0's; the driver's ``caches`` are not used: every rank writes its own copy of the
    latent cache)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.world_size = spec.world_size
        self._failure: str | None = None
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.shutdown, False)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or free_port(addr))
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        try:
            for rank, (cores, threads) in enumerate(core_slices(spec.world_size)):
                rank_spec = replace(
                    spec,
                    rank=rank,
                    master_addr=addr,
                    master_port=port,
                    cores=cores,
                    threads=threads,
                )
                driver_end, worker_end = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    args=(rank_spec, worker_end, os.getpid()),
                    name=f"mlafx-tp-rank{rank}",
                )
                process.start()
                worker_end.close()
                self._workers.processes.append(process)
                self._workers.conns.append(driver_end)
            ranks = list(range(spec.world_size))
            self._collect(ranks, "build its shard")
            # Rank 0 compiles alone; the others then load its package from the cache.
            self._command([0], "compile", None, "compile its step")
            self._command(ranks[1:], "compile", None, "load the compiled step")
            self._command(ranks, "connect", None, f"join the process group at {addr}:{port}")
        except BaseException:
            self._finalizer()
            raise
        log.info("tensor parallel: %d ranks, pids %s", spec.world_size, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._workers.processes]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        wire = step_to_wire(input_ids, positions, meta, logits_indices)
        replies = self._command(list(range(self.world_size)), "step", wire, "run a step")
        return tensor_from_wire(replies[0])

    def close(self) -> None:
        """Stop every worker (gracefully, then by signal); idempotent."""
        if self._finalizer.alive:
            self._finalizer.detach()
            self._workers.shutdown(graceful=self._failure is None)

    # ----- messaging -----
    def _command(self, ranks: list[int], kind: str, payload: Any, what: str) -> list[Any]:
        self._check_alive()
        message = dumps((kind, payload))
        for rank in ranks:
            try:
                self._workers.conns[rank].send_bytes(message)
            except OSError:
                pass  # its death is reported by _collect
        return self._collect(ranks, what)

    def _collect(self, ranks: list[int], what: str) -> list[Any]:
        """The replies of ``ranks`` in rank order; raises ``TensorParallelError`` as soon as
        one of them reports an error or dies."""
        conns, processes = self._workers.conns, self._workers.processes
        replies: dict[int, Any] = {}
        while len(replies) < len(ranks):
            pending = [r for r in ranks if r not in replies]
            ready = wait([conns[r] for r in pending] + [processes[r].sentinel for r in pending])
            for rank in pending:
                if conns[rank] in ready:
                    try:
                        status, value = loads(conns[rank].recv_bytes())
                    except (EOFError, OSError):
                        status, value = "died", None
                    if status == "ok":
                        replies[rank] = value
                        continue
                    if status == "error":
                        self._fail(f"tensor-parallel rank {rank} failed to {what}: {value}")
                if conns[rank] in ready or processes[rank].sentinel in ready:
                    processes[rank].join(1.0)
                    self._fail(
                        f"tensor-parallel rank {rank} (pid {processes[rank].pid}) exited with "
                        f"code {processes[rank].exitcode} while asked to {what}"
                    )
        return [replies[r] for r in ranks]

    def _fail(self, message: str) -> None:
        self._failure = message
        self.close()
        raise TensorParallelError(message)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self._failure}")
        if not self._finalizer.alive:
            raise TensorParallelError("the tensor-parallel group is closed")


def start_workers(
    config: ModelConfig,
    *,
    world_size: int,
    model_dir: str | None,
    load_format: str,
    dtype: str,
    seed: int,
    block_size: int,
    num_blocks: int,
    compile: bool,
    compile_cache_dir: str | os.PathLike[str] | None,
) -> WorkerGroup:
    """A started ``WorkerGroup`` for the full model ``config`` (see ``sharding`` for the
    split). Packages go to ``<compile cache>/tp<N>``: a shard's graph holds all-reduces that
    an unsharded model of the same shapes does not, so the two must never share a key."""
    from pathlib import Path

    from mlafx.export.compiled_step import default_cache_dir
    from mlafx.parallel.sharding import check_shardable

    check_shardable(config, world_size)
    base = default_cache_dir() if compile_cache_dir is None else Path(compile_cache_dir)
    spec = WorkerSpec(
        rank=0,
        world_size=world_size,
        config=config,
        model_dir=model_dir,
        load_format=load_format,
        dtype=dtype,
        seed=seed,
        block_size=block_size,
        num_blocks=num_blocks,
        compile=compile,
        compile_cache_dir=str(base / f"tp{world_size}"),
        master_addr="",
        master_port=0,
        cores=(),
        threads=1,
    )
    return WorkerGroup(spec)
