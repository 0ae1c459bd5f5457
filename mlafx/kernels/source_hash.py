"""The fingerprint of the C++ sources, shared by the build (``setup.py``) and the loader.

The build records ``csrc_sha256(csrc)`` in ``_build_info.py``; the loader recomputes it and
refuses a ``mlafx._C`` built from other sources. Standard library only: ``setup.py`` loads
this file by path, before the package (which needs the built extension) can be imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent / "csrc"


def csrc_files(csrc_dir: Path = CSRC_DIR) -> list[Path]:
    """Every source file under ``csrc_dir``, sorted; dotfiles (editor swap files) skipped."""
    return sorted(
        path
        for path in csrc_dir.rglob("*")
        if path.is_file()
        and not any(part.startswith(".") for part in path.relative_to(csrc_dir).parts)
    )


def csrc_sha256(csrc_dir: Path = CSRC_DIR) -> str:
    """sha256 over the relative path and bytes of every file in ``csrc_dir``."""
    digest = hashlib.sha256()
    for path in csrc_files(csrc_dir):
        digest.update(path.relative_to(csrc_dir).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()
