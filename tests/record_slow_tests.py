"""Rewrite ``tests/slow_tests.txt`` from JUnit reports: every test whose setup + call +
teardown took more than ``SECONDS`` in any of them (a cold compile of an engine, a child
process that imports torch, a long kernel sweep). ``make test-fast`` deselects them
(``conftest.py``). Give it a cold full run's report and a cold ``-m "not slow"`` run's: a
module fixture that compiles is paid by the first test that uses it, so leaving that one out
moves the cost to the next.

    .venv/bin/python tests/record_slow_tests.py REPORT.xml...   # from `make slow-tests`
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SECONDS = 3.0
LIST = Path(__file__).resolve().parent / "slow_tests.txt"
HEADER = """\
# Tests `make test-fast` leaves out (conftest.py marks them `slow`): each took more than
# {seconds:g} s in a cold run of the suite or of its fast tier (`make slow-tests` rewrites
# the test ids; tests/record_slow_tests.py), and every test of PATH that uses a fixture named
# by a `fixture PATH::NAME` line (a module fixture that compiles an engine). Mostly cold
# compiles.
"""


def slow_ids(report: Path) -> list[tuple[float, str]]:
    rows = []
    for case in ET.parse(report).iter("testcase"):
        seconds = float(case.get("time") or 0)
        if seconds > SECONDS:
            path = case.get("classname", "").replace(".", "/") + ".py"
            rows.append((seconds, f"{path}::{case.get('name')}"))
    return sorted(rows, reverse=True)


def main() -> None:
    slowest: dict[str, float] = {}
    for report in sys.argv[1:]:
        for seconds, node_id in slow_ids(Path(report)):
            slowest[node_id] = max(seconds, slowest.get(node_id, 0.0))
    rows = sorted(((s, n) for n, s in slowest.items()), reverse=True)
    lines = [f"{node_id}  # {seconds:.0f} s" for seconds, node_id in rows]
    # hand-written lines naming a module's compiling fixture are kept as they are
    kept = [line for line in LIST.read_text().splitlines() if line.startswith("fixture ")]
    LIST.write_text(HEADER.format(seconds=SECONDS) + "\n".join(kept + lines) + "\n")
    print(f"{len(rows)} slow tests -> {LIST}")


if __name__ == "__main__":
    main()
