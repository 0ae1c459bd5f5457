"""GGUF files (llama.cpp's format) by header: the metadata and where each tensor's bytes are.

Read with the ``gguf`` package's ``GGUFReader`` (llama.cpp's own reader), which maps the file
and parses its header; no tensor byte is read here. A model split by ``llama-gguf-split``
(``NAME-00001-of-0000N.gguf``) is one ``GgufFile``: the first part holds the metadata, every
part holds some tensors (``split.count`` says how many parts; each is opened and checked).

Shapes: GGUF lists a tensor's dimensions innermost first (ggml's ``ne``); ``GgufTensor.shape``
is torch's order (outermost first), so a weight ``[out, in]`` reads as in ``nn.Linear``. A
block-quantized tensor's rows are ``shape[-1] / block_size`` blocks of ``block_bytes`` each.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlafx.config.model_config import ConfigError

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file: its ggml type, torch-order shape and byte range."""

    name: str
    type_name: str  # ggml type: "F32", "BF16", "Q8_0", "Q4_K", ...
    shape: tuple[int, ...]  # torch order (outermost first)
    file: Path
    offset: int  # absolute, in ``file``
    length: int  # bytes

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GgufFile:
    """A GGUF model (one file, or every part of a split one)."""

    path: Path  # the first (or only) file
    files: tuple[Path, ...]
    metadata: dict[str, Any]  # key -> Python value (str, int, float, bool, list)
    tensors: dict[str, GgufTensor]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ConfigError(f"{self.path}: GGUF metadata 'general.architecture' is missing")
        return arch

    @property
    def nbytes(self) -> int:
        return sum(t.length for t in self.tensors.values())


def is_gguf(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix; the file is checked when opened)."""
    return str(model).endswith(".gguf")


def split_parts(path: Path) -> tuple[Path, ...]:
    """Every part of a split model named by any of its parts (or the file alone)."""
    m = _SPLIT.match(path.name)
    if m is None:
        return (path,)
    count = int(m.group("count"))
    parts = tuple(
        path.with_name(f"{m.group('stem')}-{no:05d}-of-{count:05d}.gguf")
        for no in range(1, count + 1)
    )
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ConfigError(f"split GGUF {path.name}: part(s) {', '.join(missing)} do not exist")
    return parts


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


def _read_one(path: Path) -> tuple[dict[str, Any], list[GgufTensor]]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: not a readable GGUF file ({e})") from None
    metadata = {name: _field_value(field) for name, field in reader.fields.items()}
    tensors = [
        GgufTensor(
            name=t.name,
            type_name=t.tensor_type.name,
            shape=tuple(int(d) for d in reversed(t.shape.tolist())),
            file=path,
            offset=int(t.data_offset),
            length=int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    del reader  # its mapping of the file goes with it
    return metadata, tensors


def open_gguf(model: str | Path) -> GgufFile:
    """Parse the header(s) of a GGUF model; ``ConfigError`` naming the file for a missing,
    unreadable or inconsistent one. Parsed once per file version (the config, the loader and
    the tokenizer all ask)."""
    path = Path(model)
    if not path.is_file():
        raise ConfigError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _open(path.resolve(), stat.st_mtime_ns, stat.st_size, stat.st_ino)


@functools.lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int, inode: int) -> GgufFile:
    files = split_parts(path)
    metadata: dict[str, Any] = {}
    tensors: dict[str, GgufTensor] = {}
    for no, part in enumerate(files):
        meta, found = _read_one(part)
        if no == 0:
            metadata = meta
        count = meta.get("split.count", 1)
        if len(files) > 1 and (count != len(files) or meta.get("split.no", no) != no):
            raise ConfigError(
                f"{part.name}: metadata split.no={meta.get('split.no')} split.count={count} "
                f"does not match its name (part {no + 1} of {len(files)})"
            )
        for tensor in found:
            if tensor.name in tensors:
                raise ConfigError(f"GGUF tensor {tensor.name!r} is in two parts ({part.name})")
            tensors[tensor.name] = tensor
    expected = metadata.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise ConfigError(
            f"{path.name}: split.tensors.count={expected} but the parts hold {len(tensors)}"
        )
    return GgufFile(path=files[0], files=files, metadata=metadata, tensors=tensors)
