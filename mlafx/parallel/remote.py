"""A tensor-parallel rank on another machine: ``python -m mlafx.parallel.remote --rank R``.

Run it on each machine that holds ranks ``local_ranks .. N-1`` of a driver started with
``LLM(..., tensor_parallel_size=N, tensor_parallel_local_ranks=L)`` (or
``mlafx run --tensor-parallel-size N --tensor-parallel-local-ranks L``), with the driver's
environment:

    MASTER_ADDR      the driver's address (reachable from here; rank 0 runs there)
    MASTER_PORT      the process group's port; the driver also listens on MASTER_PORT + 1
    MLAFX_TP_AUTHKEY the same secret as the driver's (the connection carries pickles)
    GLOO_SOCKET_IFNAME  the network interface to use, when a machine has several

The rank connects to the driver (retrying for ``--wait`` seconds), receives its part of the
engine (config, weights source, dtype, block size, cache size; a checkpoint directory must
exist at the same path here), builds and compiles its shard on this machine's cores, joins
the process group and serves steps until the driver closes the connection.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Client, Connection

from mlafx.parallel.wire import dumps, loads
from mlafx.parallel.worker import WorkerSpec, remote_authkey, worker_main


def connect_to_driver(rank: int, wait_seconds: float) -> Connection:
    addr = os.environ.get("MASTER_ADDR")
    port = os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ValueError("set MASTER_ADDR and MASTER_PORT to the driver's rendezvous")
    key = remote_authkey()
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            conn = Client((addr, int(port) + 1), authkey=key)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    conn.send_bytes(dumps(("hello", rank)))
    return conn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlafx.parallel.remote")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--threads", type=int, default=None, help="default: all cores here")
    parser.add_argument("--wait", type=float, default=300.0, help="seconds to find the driver")
    args = parser.parse_args(argv)
    conn = connect_to_driver(args.rank, args.wait)
    spec = loads(conn.recv_bytes())
    if not isinstance(spec, WorkerSpec):  # ("error", reason): the driver refused this rank
        print(f"the driver refused rank {args.rank}: {spec[1]}", file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    worker_main(replace(spec, cores=(), threads=threads), conn, parent_pid=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
