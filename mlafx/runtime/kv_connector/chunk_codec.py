"""One stored chunk as bytes: a safetensors blob that describes and checks itself.

A chunk is ``chunk_blocks`` consecutive cache blocks of every cache. Its bytes are a
safetensors file with one tensor per cache, ``layer.{i}: [chunk_blocks, rows, width]`` in the
cache dtype (``rows``: ``block_size`` token rows, or a DeepSeek-V4 pool's entries per block),
and string metadata::

    format       "mlafx-kv-chunk/1"
    fingerprint  the cache fingerprint (hex) the rows were computed under
    key          the chunk's key (hex): the chained key of its last block
    block_size, chunk_blocks, num_layers, dtype ("bfloat16", ...)
    sha256       over every layer's raw bytes, in layer order

``decode_chunk`` accepts a blob only if every one of these matches what the reader
expects and the checksum holds, so a truncated, bit-flipped, foreign or mislabelled entry
raises ``ChunkDecodeError`` (the caller's miss) instead of yielding wrong rows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "mlafx-kv-chunk/1"


class ChunkDecodeError(ValueError):
    """A stored chunk that must not be used (corrupt, truncated or for another cache)."""


@dataclass(frozen=True)
class ChunkSpec:
    """What a reader expects of a chunk (everything but its rows)."""

    fingerprint: str
    key: bytes
    block_size: int
    chunk_blocks: int
    dtype: torch.dtype
    block_shapes: tuple[tuple[int, int], ...]  # (rows, width) of one block of each cache

    @classmethod
    def for_caches(
        cls,
        fingerprint: str,
        key: bytes,
        block_size: int,
        chunk_blocks: int,
        caches: Sequence[torch.Tensor],
    ) -> ChunkSpec:
        return cls(
            fingerprint=fingerprint,
            key=key,
            block_size=block_size,
            chunk_blocks=chunk_blocks,
            dtype=caches[0].dtype,
            block_shapes=tuple((cache.shape[1], cache.shape[2]) for cache in caches),
        )

    def metadata(self, checksum: str) -> dict[str, str]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "key": self.key.hex(),
            "block_size": str(self.block_size),
            "chunk_blocks": str(self.chunk_blocks),
            "num_layers": str(len(self.block_shapes)),
            "dtype": _dtype_name(self.dtype),
            "sha256": checksum,
        }


def encode_chunk(spec: ChunkSpec, layers: Sequence[torch.Tensor]) -> bytes:
    """Serialise ``layers`` (``[chunk_blocks, rows, width]`` each, ``spec``'s shapes
    and dtype) as ``spec``'s chunk."""
    tensors = {f"layer.{i}": layer.contiguous() for i, layer in enumerate(layers)}
    return st_save(tensors, metadata=spec.metadata(_checksum(tensors.values())))


def decode_chunk(spec: ChunkSpec, data: bytes) -> list[torch.Tensor]:
    """The per-layer rows stored in ``data``; ``ChunkDecodeError`` unless it is exactly
    ``spec``'s chunk, whole and unaltered."""
    expected = spec.metadata(checksum="")
    stored = _read_metadata(data)
    for name, value in expected.items():
        if name != "sha256" and stored.get(name) != value:
            raise ChunkDecodeError(f"{name} is {stored.get(name)!r}, expected {value!r}")
    try:
        tensors = st_load(data)
    except Exception as e:  # safetensors raises its own error type for bad buffers
        raise ChunkDecodeError(f"unreadable safetensors data: {e}") from e
    names = [f"layer.{i}" for i in range(len(spec.block_shapes))]
    if sorted(tensors) != sorted(names):
        raise ChunkDecodeError(f"tensor names {sorted(tensors)} are not layer.0..")
    layers = [tensors[name] for name in names]
    _check_layers(spec, layers)
    if _checksum(layers) != stored.get("sha256"):
        raise ChunkDecodeError("checksum mismatch")
    return layers


def _read_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors blob (header: u64 LE length, then JSON)."""
    if len(data) < 8:
        raise ChunkDecodeError(f"{len(data)} bytes is too short for a safetensors header")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ChunkDecodeError(f"header of {header_len} bytes runs past the end")
    try:
        header = json.loads(data[8 : 8 + header_len])
        metadata = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as e:
        raise ChunkDecodeError(f"unreadable header: {e!r}") from e
    if not isinstance(metadata, dict):
        raise ChunkDecodeError("header metadata is not a mapping")
    return metadata


def _check_layers(spec: ChunkSpec, layers: Sequence[torch.Tensor]) -> None:
    if len(layers) != len(spec.block_shapes):
        raise ChunkDecodeError(f"{len(layers)} layers, expected {len(spec.block_shapes)}")
    for i, (layer, block) in enumerate(zip(layers, spec.block_shapes, strict=True)):
        shape = (spec.chunk_blocks, *block)
        if tuple(layer.shape) != shape or layer.dtype != spec.dtype:
            raise ChunkDecodeError(
                f"layer {i} is {tuple(layer.shape)} {layer.dtype}, expected {shape} {spec.dtype}"
            )


def _checksum(layers) -> str:
    digest = hashlib.sha256()
    for layer in layers:
        digest.update(layer.contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
