"""The one policy for the system tools tests use: the Makefile installs them
(``make system-deps``: graphviz, chromium, redis-server; binutils comes with the compiler the
build needs), so a missing one is a failure saying how to get it, never a skip. Tests skip
only for what the platform cannot have (a CPU feature)."""

from __future__ import annotations

import shutil

_HOW = {
    "dot": "run `make system-deps` (it apt-installs Debian's graphviz)",
    "chromium": "run `make system-deps` (it apt-installs Debian's chromium)",
    "redis-server": "run `make system-deps` (it apt-installs Debian's redis-server)",
    "objdump": "install binutils (it comes with the C++ compiler the build needs)",
}


def require(tool: str) -> str:
    """The path of ``tool``; ``RuntimeError`` naming how to install it when it is missing."""
    path = shutil.which(tool)
    if path is None:
        raise RuntimeError(f"{tool} is not installed: {_HOW[tool]}")
    return path
