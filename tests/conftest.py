"""Suite-wide set-up: compiled steps and inductor's own cache live inside the repo
(``.cache/``, gitignored), so a configuration is compiled once per machine and every
later test session, test and CLI subprocess reuses it."""

from __future__ import annotations

import os
from pathlib import Path

_CACHE = Path(__file__).resolve().parent.parent / ".cache"
os.environ.setdefault("MLAFX_CACHE_DIR", str(_CACHE / "compiled"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_CACHE / "inductor"))
