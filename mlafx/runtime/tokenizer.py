"""Optional text support: a model directory's ``tokenizer.json`` (HF ``tokenizers``), or a GGUF
file's tokenizer metadata (``config/gguf_tokenizer.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model: str | Path) -> Any | None:
    """The directory's (or GGUF file's) tokenizer, or None when there is none (token-id
    prompts only)."""
    if str(model).endswith(".gguf"):
        from mlafx.config.gguf_file import open_gguf
        from mlafx.config.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(open_gguf(model))
    path = Path(model) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
