"""The package cache's locks (``compile/package_lock.py``): a process needing several packages
gets the ones nobody else is building first, and waits only when every one left is held."""

from __future__ import annotations

import threading

import pytest

from mlafx.compile.package_lock import free_first, package_lock


def test_packages_nobody_holds_are_got_first_then_the_held_one_once_let_go(tmp_path):
    paths = [tmp_path / f"layer-{i}.pt2" for i in range(3)]
    held, let_go = threading.Event(), threading.Event()

    def other_process() -> None:  # flock: another open file description is another holder
        with package_lock(paths[0]) as got:
            assert got
            held.set()
            let_go.wait(30)

    other = threading.Thread(target=other_process)
    other.start()
    assert held.wait(30)
    attempts: list[tuple[int, bool, bool]] = []

    def get(i: int, wait: bool) -> str | None:
        with package_lock(paths[i], wait=wait) as got:
            attempts.append((i, wait, got))
            if not got:
                if {1, 2} <= {a for a, _, ok in attempts if ok}:
                    let_go.set()  # nothing else left: the other holder finishes
                return None
            return f"package {i}"

    assert free_first(3, get) == ["package 0", "package 1", "package 2"]
    other.join(30)
    assert [(i, wait) for i, wait, got in attempts if got] == [(1, False), (2, False), (0, True)]
    assert [i for i, _, got in attempts if not got] == [0, 0, 0]


def test_a_lock_not_waited_for_holds_nothing(tmp_path):
    package = tmp_path / "layer.pt2"
    with package_lock(package) as got:
        assert got
        with package_lock(package, wait=False) as again:
            assert not again
        with pytest.raises(ValueError) as raised, package_lock(package, wait=False):
            raise ValueError("the caller's own error")
        assert raised.value.__context__ is None  # not chained to the lock's BlockingIOError
    with package_lock(package, wait=False) as free:
        assert free
