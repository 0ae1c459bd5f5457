"""One tensor-parallel rank: a process with its own cores, thread pool, shard model,
compiled step and latent caches, driven by ``group.WorkerGroup`` over a pipe (a socket for
a rank on another machine, see ``remote``).

Protocol (each message a pickled tuple; see ``wire``): the worker builds its shard and sends
``("ok", None)``; then, per driver command, replies ``("ok", payload)`` or, if the command
raised, ``("error", traceback text)`` and exits:

    ("compile", None)   compile (rank 0, alone: no process group yet, so its all-reduces
                        are the identity while it captures and verifies) or load the
                        package rank 0 built (the others); no-op on the reference path
    ("connect", None)   join the gloo process group (``env://``: MASTER_ADDR/MASTER_PORT)
    ("step", wire)      run the step on this rank's caches; payload: rank 0's logits
    ("close", None)     leave the group and exit

The worker exits when the driver's end of the pipe closes or the driver process is gone
(checked twice a second), so a driver that dies leaves no worker behind.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mlafx.config import ModelConfig
from mlafx.kernels import batch_invariant_mode
from mlafx.models.loader import build_model, torch_dtype
from mlafx.parallel import collectives
from mlafx.parallel.sharding import shard_model
from mlafx.parallel.wire import dumps, loads, step_from_wire, tensor_to_wire

# A rank waits this long in a collective for a peer before raising (gloo waits 30 minutes by
# default). Ranks run the same step in lockstep, so a legitimate wait is the skew between
# them; the driver detects a dead worker by its process, not by this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=20)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a rank needs to build its part of the engine (picklable)."""

    rank: int
    world_size: int
    config: ModelConfig
    model_dir: str | None  # None: a preset (dummy weights)
    load_format: str
    dtype: str
    quantization: str | None  # on-load int8/int4; a checkpoint stored quantized loads as stored
    seed: int
    block_size: int
    num_blocks: int
    compile: bool
    compile_cache_dir: str  # this tensor-parallel size's package directory
    master_addr: str
    master_port: int
    cores: tuple[int, ...]  # CPUs this rank is pinned to (empty: not pinned)
    threads: int


class _Rank:
    """The shard model, its step callable and its caches."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        full = build_model(
            spec.config,
            spec.dtype,
            spec.load_format,  # type: ignore[arg-type]
            spec.model_dir,
            seed=spec.seed,
            progress=False,
            quantization=spec.quantization,  # type: ignore[arg-type]
        )
        self.model = shard_model(full, spec.rank, spec.world_size)
        del full
        collectives.install_all_reduce(self.model)
        self.step_fn: Any = self.model
        # The caches have no head axis: every rank holds (and writes) the full rows (the DSA
        # indexer is replicated, not sharded).
        self.caches = [
            torch.zeros(spec.num_blocks, spec.block_size, width, dtype=torch_dtype(spec.dtype))
            for width in spec.config.cache_widths
        ]

    def compile(self) -> float:
        if not self.spec.compile:
            return 0.0
        from mlafx.compile.compiled_step import compile_step

        self.step_fn = compile_step(
            self.model, self.spec.block_size, cache_dir=Path(self.spec.compile_cache_dir)
        )
        return self.step_fn.compile_seconds

    def connect(self) -> None:
        os.environ["MASTER_ADDR"] = self.spec.master_addr
        os.environ["MASTER_PORT"] = str(self.spec.master_port)
        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=self.spec.rank,
            world_size=self.spec.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )

    def step(self, payload: Any) -> Any:
        wire, invariant = payload  # the step, and the driver's batch-invariant mode
        input_ids, positions, meta, logits_indices = step_from_wire(wire)
        with torch.no_grad(), batch_invariant_mode(invariant):
            logits = self.step_fn(input_ids, positions, self.caches, meta, logits_indices)
        return tensor_to_wire(logits) if self.spec.rank == 0 else None


def _exit_with_parent(parent_pid: int) -> None:
    """Exit the process as soon as the driver is gone (even mid-compute)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="mlafx-tp-parent-watch", daemon=True).start()


def _bind_cores(spec: WorkerSpec) -> None:
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
    torch.set_num_threads(spec.threads)


def remote_authkey() -> bytes:
    """The shared secret of remote ranks and their driver (``MLAFX_TP_AUTHKEY``): the
    connection carries pickles, so only a peer that knows it may connect."""
    key = os.environ.get("MLAFX_TP_AUTHKEY")
    if not key:
        raise ValueError(
            "ranks on other machines need a shared secret: set MLAFX_TP_AUTHKEY (the same "
            "value) for the driver and every remote rank"
        )
    return key.encode()


def worker_main(spec: WorkerSpec, conn: Connection, parent_pid: int | None) -> None:
    """Serve rank ``spec.rank`` over ``conn`` until told to close or the driver is gone.
    ``parent_pid``: the driver's pid, for a local rank (exit as soon as it is gone)."""
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
        # Ctrl-C in a terminal reaches the whole process group: the driver handles it (and
        # stops the ranks); a rank interrupted mid-step would only obscure the error.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rank = _Rank(spec)
        conn.send_bytes(dumps(("ok", None)))
        while True:
            kind, payload = loads(conn.recv_bytes())
            if kind == "step":
                reply = rank.step(payload)
            elif kind == "compile":
                reply = rank.compile()
            elif kind == "connect":
                _bind_cores(spec)  # after compiling, which may use every core
                rank.connect()
                reply = None
            elif kind == "close":
                if dist.is_initialized():
                    dist.destroy_process_group()
                conn.send_bytes(dumps(("ok", None)))
                return
            else:
                raise ValueError(f"unknown tensor-parallel command {kind!r}")
            conn.send_bytes(dumps(("ok", reply)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the driver closed the pipe: nothing left to serve
    except BaseException:
        text = f"rank {spec.rank} (pid {os.getpid()}):\n{traceback.format_exc()}"
        try:
            conn.send_bytes(dumps(("error", text)))
        except OSError:
            print(text, file=sys.stderr)
        sys.exit(1)
