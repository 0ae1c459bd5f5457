"""Safetensors files by byte range: where each tensor's bytes are, and private mappings of them.

Layout: ``u64 little-endian header length N | N bytes of JSON | data``; the JSON maps each name
to ``{"dtype", "shape", "data_offsets": [begin, end]}``, offsets relative to byte ``8 + N``.

``map_bytes`` maps one tensor's bytes on their own: ``mmap(MAP_PRIVATE)`` of the pages that hold
them, from a file opened read-only, seen as a uint8 tensor that unmaps them when it (and every
view of it) is freed. One mapping per tensor, not one per file (safetensors 0.8's
``safe_open(..., framework="pt").get_tensor`` hands out views into a single
``UntypedStorage.from_file`` of the whole file), because RSS counts every resident page a live
mapping holds:
- A weight dropped after load (a compiled engine may replace a linear weight by a packed layout
  derived from it) was read once; under a per-file mapping its pages stay mapped, and counted,
  until the file's last tensor dies. Its own mapping gives them back when it goes (the page
  cache keeps them, clean and reclaimable, but no longer in this process's RSS).
- A tensor read only to be copied (a dtype cast, a slice of a fused expert stack) is unmapped
  right after the copy: a load holds the model plus one source tensor, not the model plus every
  page of the file read so far.
Costs: one VMA per tensor (~10-20 per layer; Linux allows 65530 by default) and the page at
each end of a tensor mapped twice when a neighbour shares it. Python's ``mmap.mmap`` keeps a
duplicated file descriptor per mapping (until ``trackfd=False``, Python 3.13): a thousand
weights would exhaust a 1024-descriptor limit. So libc's ``mmap`` is called through ctypes and
the caller closes its one descriptor per file once that file's tensors are mapped (a mapping
outlives the descriptor). ``UntypedStorage.from_file`` takes no offset: it would map the file's
whole prefix up to each tensor.

Copy-on-write: the pages are mapped writable but private, so a write into a mapped tensor (mlafx
makes none after load) lands in this process's own copy of that page and never reaches the file,
which is opened ``O_RDONLY`` anyway; read-only protection would turn such a write into a SIGSEGV
of the whole process, without a Python traceback. What a mapping cannot survive is the file
being rewritten in place while it is mapped (``save_file`` truncates and writes the same inode):
pages not yet read then show the new bytes, or past the new end of the file raise SIGBUS. Write
a new file and rename it over the old one; the mapping keeps the old inode.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# safetensors dtype codes -> torch dtypes (little-endian, as the format stores them)
STORED_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # ue8m0 scales (DeepSeek-V4's FP8 and FP4 weights)
}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are inside a safetensors file (absolute byte offsets)."""

    dtype: str  # safetensors dtype code: "F32", "BF16", ...
    shape: tuple[int, ...]
    offset: int
    length: int


def tensor_locations(path: Path) -> dict[str, StoredTensor]:
    """Parse a safetensors header: ``8-byte little-endian header length | JSON | data``."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    return {
        name: StoredTensor(
            entry["dtype"],
            tuple(entry["shape"]),
            base + entry["data_offsets"][0],
            entry["data_offsets"][1] - entry["data_offsets"][0],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,  # addr
    ctypes.c_size_t,  # length
    ctypes.c_int,  # prot
    ctypes.c_int,  # flags
    ctypes.c_int,  # fd
    ctypes.c_long,  # offset (off_t: 64-bit on LP64 Linux)
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _PrivateMapping:
    """One ``MAP_PRIVATE`` mapping of a file's byte range, unmapped when garbage collected.

    numpy arrays made from it (its ``__array_interface__``) keep it as their base, and
    ``torch.from_numpy`` keeps the array, so the mapping lives exactly as long as the last
    tensor over it."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets are page-aligned
        self._length = offset - start + length
        addr = _libc.mmap(
            None, self._length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, start
        )
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {length} bytes at offset {offset}: {os.strerror(err)}")
        self._addr = addr
        self.__array_interface__ = {
            "version": 3,
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr + offset - start, False),  # (pointer, read-only?)
        }

    def __del__(self) -> None:
        _libc.munmap(self._addr, self._length)


def map_bytes(fd: int, offset: int, length: int) -> torch.Tensor:
    """``[length]`` uint8 over a private mapping of bytes ``[offset, offset + length)`` of the
    file open (read-only) as ``fd``; the descriptor may be closed right after."""
    size = os.fstat(fd).st_size
    if offset < 0 or offset + length > size:  # reading a mapping past the end raises SIGBUS
        raise ValueError(f"bytes [{offset}, {offset + length}) lie outside the {size}-byte file")
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.asarray(_PrivateMapping(fd, offset, length)))


def map_stored(fd: int, stored: StoredTensor) -> torch.Tensor:
    """The stored tensor in its own dtype and shape over its own private mapping (over an
    aligned copy when its bytes start at an offset its element size does not divide)."""
    dtype = STORED_DTYPES[stored.dtype]
    raw = map_bytes(fd, stored.offset, stored.length)
    if stored.offset % dtype.itemsize != 0:
        raw = raw.clone()
    return raw.view(dtype).view(stored.shape)


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each over its own private mapping."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return {name: map_stored(fd, stored) for name, stored in tensor_locations(path).items()}
    finally:
        os.close(fd)
