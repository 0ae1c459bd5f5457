"""How processes share the on-disk package cache: a package is looked up and, if missing,
built under a lock of its own (``package_lock``), and a process that needs several packages
takes them free ones first (``free_first``), so that two processes starting the same model on
an empty cache build different layer kinds side by side, instead of one waiting on each lock
the other holds."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def package_lock(package: Path, *, wait: bool = True) -> Iterator[bool]:
    """Held while ``package`` is looked up and, if missing, built: a second process that
    wants the same package waits here, then finds it built. With ``wait=False`` it does not
    wait: the context gives False (and holds nothing) while another holder has the lock."""
    package.parent.mkdir(parents=True, exist_ok=True)
    with open(package.with_name(f".{package.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = False
        else:
            held = True
        if not held:  # outside the handler: an error in the caller's block is not chained to it
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_first(count: int, get: Callable[[int, bool], T | None]) -> list[T]:
    """``[get(0, ...), ..., get(count - 1, ...)]``, got free ones first: ``get(i, wait)``
    looks package ``i`` up or builds it under its ``package_lock``, and with ``wait=False``
    returns None instead of waiting for another holder. Each turn takes the first package left
    whose lock is free (a lookup or a build), and waits only when every one left is held."""
    got: dict[int, T] = {}
    left = list(range(count))
    while left:
        for i in left:
            result = get(i, False)
            if result is not None:
                break
        else:
            i = left[0]
            result = get(i, True)
            assert result is not None, "get(i, wait=True) waits for the lock: never None"
        got[i] = result
        left.remove(i)
    return [got[i] for i in range(count)]
