"""Suite-wide set-up: compiled steps and inductor's own cache live inside the repo
(``.cache/``, gitignored), so a configuration is compiled once per machine and every
later test session, test and CLI subprocess reuses it. Tests listed in ``slow_tests.txt``
get the ``slow`` marker (``make test-fast`` runs ``-m "not slow"``) and run first: the long
ones start early, so the workers finish together.

Threads: N xdist workers on C cores give each worker (and the processes it starts) C // N
torch threads (``OMP_NUM_THREADS``), unless the caller set it: two 2-thread workers on two
cores stall each other's OpenMP steps (a 17 % longer run here). The kernel tests
(``test_kernel_*``, ``test_parallel_chunks``) keep every core, and their child processes
too: they check how kernels split work across threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_CACHE = Path(__file__).resolve().parent.parent / ".cache"
os.environ.setdefault("MLAFX_CACHE_DIR", str(_CACHE / "compiled"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))

# ---- threads per xdist worker ----------------------------------------------------------------
_CORES = os.cpu_count() or 1
_CALLERS_THREADS = os.environ.get("OMP_NUM_THREADS")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_SHARE_CORES = _WORKERS > 1 and _CALLERS_THREADS is None
if _SHARE_CORES:
    os.environ["OMP_NUM_THREADS"] = str(max(1, _CORES // _WORKERS))
    torch.set_num_threads(max(1, _CORES // _WORKERS))
_EVERY_CORE_MODULES = ("test_kernel_", "test_parallel_chunks")


@pytest.fixture(autouse=True)
def _kernel_tests_use_every_core(request, monkeypatch):  # type: ignore[no-untyped-def]
    name = request.module.__name__.rpartition(".")[2]
    if not _SHARE_CORES or not name.startswith(_EVERY_CORE_MODULES):
        yield
        return
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(_CORES)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- tiers: `make test-fast` runs the suite minus the tests listed in slow_tests.txt ----------
_SLOW_LIST = Path(__file__).resolve().parent / "slow_tests.txt"


def _slow_entries() -> tuple[dict[str, float], set[tuple[str, str]]]:
    """(test id -> its recorded seconds, (module path, fixture name)) listed in
    slow_tests.txt (``<id>  # 131 s``; 0 where no time is recorded)."""
    ids: dict[str, float] = {}
    fixtures = set()
    lines = _SLOW_LIST.read_text().splitlines() if _SLOW_LIST.is_file() else []
    for line in lines:
        entry, _, comment = (part.strip() for part in line.partition("#"))
        if entry.startswith("fixture "):
            path, _, name = entry.removeprefix("fixture ").partition("::")
            fixtures.add((path, name))
        elif entry:
            seconds = comment.removesuffix("s").strip()
            ids[entry] = float(seconds) if seconds.replace(".", "", 1).isdigit() else 0.0
    return ids, fixtures


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "slow: listed in tests/slow_tests.txt (mostly cold compiles); `-m 'not slow'`"
    )


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    ids, fixtures = _slow_entries()
    longest: dict[str, float] = {}  # module path -> its slowest listed test's seconds
    for item in items:
        path = item.nodeid.partition("::")[0]
        if item.nodeid in ids or any((path, f) in fixtures for f in item.fixturenames):
            item.add_marker(pytest.mark.slow)
            longest[path] = max(longest.get(path, 0.0), ids.get(item.nodeid, 0.0))

    # slow tests first, the module with the slowest test first; a module's tests stay together
    # and in their order (a module fixture is built once per worker, and a test may rely on
    # the ones before it: test_tensor_parallel's last test kills its fixture's rank), and so
    # do the fast tests (a stable sort)
    def order(item) -> tuple[bool, float, str]:  # type: ignore[no-untyped-def]
        path = item.nodeid.partition("::")[0]
        if item.get_closest_marker("slow") is None:
            return (True, 0.0, "")
        return (False, -longest[path], path)

    items.sort(key=order)
