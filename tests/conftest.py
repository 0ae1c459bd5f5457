"""Suite-wide set-up: compiled steps and inductor's own cache live inside the repo
(``.cache/``, gitignored), so a configuration is compiled once per machine and every
later test session, test and CLI subprocess reuses it. Tests listed in ``slow_tests.txt``
get the ``slow`` marker (``make test-fast`` runs ``-m "not slow"``)."""

from __future__ import annotations

import os
from pathlib import Path

_CACHE = Path(__file__).resolve().parent.parent / ".cache"
os.environ.setdefault("MLAFX_CACHE_DIR", str(_CACHE / "compiled"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))


# ---- tiers: `make test-fast` runs the suite minus the tests listed in slow_tests.txt ----------
_SLOW_LIST = Path(__file__).resolve().parent / "slow_tests.txt"


def _slow_entries() -> tuple[set[str], set[tuple[str, str]]]:
    """(test ids, (module path, fixture name)) listed in slow_tests.txt."""
    ids, fixtures = set(), set()
    lines = _SLOW_LIST.read_text().splitlines() if _SLOW_LIST.is_file() else []
    for line in lines:
        entry = line.split("#")[0].strip()
        if entry.startswith("fixture "):
            path, _, name = entry.removeprefix("fixture ").partition("::")
            fixtures.add((path, name))
        elif entry:
            ids.add(entry)
    return ids, fixtures


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    config.addinivalue_line(
        "markers", "slow: listed in tests/slow_tests.txt (mostly cold compiles); `-m 'not slow'`"
    )


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    import pytest

    ids, fixtures = _slow_entries()
    for item in items:
        path = item.nodeid.partition("::")[0]
        if item.nodeid in ids or any((path, f) in fixtures for f in item.fixturenames):
            item.add_marker(pytest.mark.slow)
