"""The driver's side of tensor parallelism: N ranks (worker processes of this machine, and
optionally of others: ``remote``) and the step callable the engine runs.

The driver is not a rank: it never waits inside a collective, so it can always notice a
failed worker. Each step it sends the step's inputs to every rank over that rank's pipe (a
socket for a remote rank) and waits for all of them (``multiprocessing.connection.wait`` on
the connections and the local processes' sentinels): rank 0 answers with the logits, the
others with an acknowledgement. A worker that raises (it sends its traceback) or dies (its
sentinel fires, or its connection ends) fails the group: the other workers are terminated
(a rank stuck in an all-reduce with a dead peer would otherwise wait for the collective
timeout) and this and every later step raise ``TensorParallelError``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Any, NoReturn

import torch

from mlafx.config import ConfigError, ModelConfig
from mlafx.config.memory import available_memory_bytes, kv_bytes_per_token, weight_bytes
from mlafx.kernels import batch_invariant
from mlafx.models.step import StepMetadata
from mlafx.parallel.quantized_shards import format_blocks
from mlafx.parallel.sharding import check_shardable
from mlafx.parallel.wire import dumps, loads, step_to_wire, tensor_from_wire
from mlafx.parallel.worker import WorkerSpec, remote_authkey, worker_main

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
    """The ranks' pipes (or sockets) and local processes; ``shutdown`` is also the
    finaliser run at interpreter exit, so it must not refer to the ``WorkerGroup``."""

    def __init__(self) -> None:
        self.conns: dict[int, Connection] = {}
        self.processes: dict[int, Any] = {}  # local ranks only

    def shutdown(self, graceful: bool) -> None:
        if graceful:
            for conn in self.conns.values():
                try:
                    conn.send_bytes(dumps(("close", None)))
                except OSError:
                    pass
        deadline = time.monotonic() + (5.0 if graceful else 0.0)
        for p in self.processes.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes.values():
            if p.is_alive():
                p.terminate()
        for p in self.processes.values():
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns.values():
            conn.close()  # a remote rank sees the end of its connection and exits
        self.processes, self.conns = {}, {}


class WorkerGroup:
    """Start ``world_size`` ranks from ``spec`` (its ``rank``, rendezvous and cores are
    filled in per rank), build and compile their shards, connect them; then callable as
    the engine's step: ``(input_ids, positions, caches, meta, logits_indices) -> logits``
    (rank 0's; the driver's ``caches`` are not used: every rank writes its own copy of the
    latent cache).

    Ranks ``0 .. local_ranks - 1`` are processes of this machine, splitting its cores; the
    others are started on other machines (``python -m mlafx.parallel.remote --rank R``,
    see there) and connect to ``MASTER_ADDR:MASTER_PORT+1`` within ``connect_timeout``
    seconds. Rank 0 is always local: it hosts the process group's store at
    ``MASTER_ADDR:MASTER_PORT`` (default ``127.0.0.1`` and a free port)."""

    def __init__(
        self, spec: WorkerSpec, local_ranks: int | None = None, connect_timeout: float = 300.0
    ) -> None:
        world_size = spec.world_size
        local_ranks = world_size if local_ranks is None else local_ranks
        if not 1 <= local_ranks <= world_size:
            raise ValueError(f"local ranks must be in 1..{world_size}, got {local_ranks}")
        self.world_size = world_size
        # StepFn: compiled ranks' kernels ignore the key rows, so the driver neither builds
        # nor ships them; reference ranks (compile=False) read them
        self.reads_key_rows = not spec.compile
        self._failure: str | None = None
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, self._workers.shutdown, False)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT") or free_port(addr))
        spec = replace(spec, master_addr=addr, master_port=port)
        listener = None
        if local_ranks < world_size:  # listen before anything slow: remote ranks may wait
            listener = Listener((addr, port + 1), authkey=remote_authkey())
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        try:
            for rank, (cores, threads) in enumerate(core_slices(local_ranks)):
                rank_spec = replace(spec, rank=rank, cores=cores, threads=threads)
                driver_end, worker_end = ctx.Pipe()
                process = ctx.Process(
                    target=worker_main,
                    args=(rank_spec, worker_end, os.getpid()),
                    name=f"mlafx-tp-rank{rank}",
                )
                process.start()
                worker_end.close()
                self._workers.processes[rank] = process
                self._workers.conns[rank] = driver_end
            if listener is not None:
                self._accept_remote(listener, spec, local_ranks, connect_timeout)
            ranks = list(range(world_size))
            self._collect(ranks, "build its shard")
            # Rank 0 compiles alone; the others then load its package from the cache (a
            # rank on another machine compiles its own the first time).
            self._command([0], "compile", None, "compile its step")
            self._command(ranks[1:], "compile", None, "load the compiled step")
            self._command(ranks, "connect", None, f"join the process group at {addr}:{port}")
        except BaseException:
            self._finalizer()
            raise
        finally:
            if listener is not None:
                listener.close()
        log.info("tensor parallel: %d ranks, local pids %s", world_size, self.pids)

    def _accept_remote(
        self, listener: Listener, spec: WorkerSpec, local_ranks: int, timeout: float
    ) -> None:
        """Accept ranks ``local_ranks ..`` (each says which it is), send each its spec."""
        wanted = set(range(local_ranks, spec.world_size))
        accepted: dict[int, Connection] = {}
        closing = threading.Event()

        def accept() -> None:
            while wanted - accepted.keys():
                try:
                    conn = listener.accept()
                    kind, rank = loads(conn.recv_bytes())
                except (OSError, EOFError, mp.AuthenticationError):
                    if closing.is_set():  # the timeout closed the listener
                        return
                    continue  # a client with the wrong key, or gone: keep listening
                if kind != "hello" or rank not in wanted or rank in accepted:
                    conn.send_bytes(dumps(("error", f"rank {rank!r} is not expected")))
                    conn.close()
                    continue
                accepted[rank] = conn

        thread = threading.Thread(target=accept, name="mlafx-tp-accept", daemon=True)
        thread.start()
        thread.join(timeout)
        missing = sorted(wanted - accepted.keys())
        if missing:
            closing.set()
            listener.close()
            thread.join(5.0)
            for conn in accepted.values():
                conn.close()
            raise TensorParallelError(
                f"tensor-parallel rank(s) {missing} did not connect to {listener.address} "
                f"within {timeout:.0f} s: on their machines run `MASTER_ADDR="
                f"{spec.master_addr} MASTER_PORT={spec.master_port} MLAFX_TP_AUTHKEY=... "
                "python -m mlafx.parallel.remote --rank R`"
            )
        for rank, conn in accepted.items():
            conn.send_bytes(dumps(replace(spec, rank=rank)))
            self._workers.conns[rank] = conn

    @property
    def pids(self) -> list[int]:
        """The process ids of the local ranks, in rank order."""
        return [p.pid for _, p in sorted(self._workers.processes.items())]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        wire = step_to_wire(input_ids, positions, meta, logits_indices)
        # the ranks run the step in the kernel mode the driver's engine runs it in
        payload = (wire, batch_invariant())
        replies = self._command(list(range(self.world_size)), "step", payload, "run a step")
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
            sentinels = {processes[r].sentinel: r for r in pending if r in processes}
            ready = wait([conns[r] for r in pending] + list(sentinels))
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
                        # a collective fails on every rank when a peer dies: name the cause
                        dead = self._dead_peer(rank)
                        if dead is not None:
                            self._fail_dead(dead, what)
                        self._fail(f"tensor-parallel rank {rank} failed to {what}: {value}")
                    self._fail_dead(rank, what)
                elif rank in processes and processes[rank].sentinel in ready:
                    self._fail_dead(rank, what)
        return [replies[r] for r in ranks]

    def _dead_peer(self, rank: int, grace: float = 2.0) -> int | None:
        """A local rank other than ``rank`` killed by a signal now or within ``grace``
        seconds (a reset connection reaches the survivors before the death is visible); a
        rank that exits by itself has reported its own error first."""
        processes = self._workers.processes
        others = {processes[r].sentinel: r for r in processes if r != rank}
        for sentinel in wait(list(others), timeout=grace) if others else []:
            process = processes[others[sentinel]]
            process.join(1.0)
            if process.exitcode is not None and process.exitcode < 0:
                return others[sentinel]
        return None

    def _fail_dead(self, rank: int, what: str) -> NoReturn:
        process = self._workers.processes.get(rank)
        if process is None:
            self._fail(
                f"tensor-parallel rank {rank} (remote) closed its connection while asked to {what}"
            )
        process.join(1.0)
        self._fail(
            f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
            f"{process.exitcode} while asked to {what}"
        )

    def _fail(self, message: str) -> NoReturn:
        self._failure = message
        self.close()
        raise TensorParallelError(message)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel group failed earlier: {self._failure}")
        if not self._finalizer.alive:
            raise TensorParallelError("the tensor-parallel group is closed")


def check_local_ranks_fit(
    config: ModelConfig,
    dtype: str,
    kv_tokens: int,
    world_size: int,
    local_ranks: int | None,
    quantization: str | None = None,
    stored: object = None,
) -> None:
    """Raise ``ConfigError`` if this machine's ranks cannot fit while they start: each builds
    the full model (quantized as it loads, or as ``stored``) and keeps a 1/N shard, and each
    (and the driver) holds a full cache."""
    local = world_size if local_ranks is None else local_ranks
    weights = weight_bytes(config, dtype, quantization, stored) * local * (1 + 1 / world_size)
    need = weights + kv_bytes_per_token(config, dtype) * kv_tokens * (local + 1)
    have = available_memory_bytes()
    if need > 0.9 * have:
        raise ConfigError(
            f"{local} tensor-parallel rank(s) of {config.model_type} need about "
            f"{need / 2**30:.1f} GiB while starting (each builds the full model, then "
            f"keeps its shard; every rank and the driver hold a KV cache of {kv_tokens} tokens), "
            f"but only {have / 2**30:.1f} GiB is available"
        )


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
    local_ranks: int | None = None,
    quantization: str | None = None,
) -> WorkerGroup:
    """A started ``WorkerGroup`` for the full model ``config`` (see ``sharding`` for the
    split; ``local_ranks``: see ``WorkerGroup``). Packages go to ``<compile cache>/tp<N>``:
    a shard's graph holds all-reduces that an unsharded model of the same shapes does not,
    so the two must never share a key."""
    from mlafx.compile.compiled_step import default_cache_dir
    from mlafx.models.loader import servable_stored_quantization

    stored = None
    if load_format == "auto" and model_dir is not None:
        stored = servable_stored_quantization(model_dir)
    check_shardable(config, world_size, format_blocks(quantization, stored))
    check_local_ranks_fit(
        config, dtype, num_blocks * block_size, world_size, local_ranks, quantization, stored
    )
    base = default_cache_dir() if compile_cache_dir is None else Path(compile_cache_dir)
    spec = WorkerSpec(
        rank=0,
        world_size=world_size,
        config=config,
        model_dir=model_dir,
        load_format=load_format,
        dtype=dtype,
        quantization=quantization,
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
    return WorkerGroup(spec, local_ranks)
