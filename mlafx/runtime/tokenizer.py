"""Optional text support: a model directory's ``tokenizer.json`` (HF ``tokenizers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model: str | Path) -> Any | None:
    """The directory's tokenizer, or None when there is none (token-id prompts only)."""
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
