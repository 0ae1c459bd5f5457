"""``disk:PATH``: chunks as safetensors files in a folder that processes may share.

Layout: ``PATH/<fingerprint>/<key hex>.c<chunk_blocks>.safetensors``. The file name is the
index: it names the chunk (the key of its last block names the whole prefix), and the file's
own metadata repeats everything (``chunk_codec``), so no separate index file has to be kept
consistent between writers. A store written under another model config, dtype, block size or
cache layout lives in another fingerprint folder: a plain miss.

Writes are atomic: the bytes go to a temporary file in the same folder, which
``os.replace`` then renames over the final name. Readers therefore see a whole file or none;
two processes writing the same chunk at once each rename a whole file of the same content.
Files are not fsync'ed (a crash may leave a truncated file, which the checksum turns into a
miss); a writer killed mid-write leaves a ``.tmp-*`` file that readers ignore.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mlafx.runtime.kv_connector.base import KVConnectorError

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"


class DiskStore:
    """A ``ChunkStore`` over one fingerprint's folder under ``root``."""

    def __init__(self, root: str | os.PathLike, fingerprint: str) -> None:
        self.root = Path(root).expanduser()
        self.folder = self.root / fingerprint
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # os.access says yes to root on a read-only mount: write and remove a probe
            probe, probe_path = tempfile.mkstemp(dir=self.folder, prefix=TEMP_PREFIX)
            os.close(probe)
            os.unlink(probe_path)
        except OSError as e:
            raise KVConnectorError(
                f"KV store folder {self.folder} cannot be created or written: {e}"
            ) from e

    def __str__(self) -> str:
        return f"disk:{self.root}"

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [self._path(name).is_file() for name in names]

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("KV store %s: cannot read %s: %s", self, name, e)
            return None

    def put(self, name: str, data: bytes) -> None:
        temp_path = None
        try:
            fd, temp_path = tempfile.mkstemp(dir=self.folder, prefix=TEMP_PREFIX)
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the chunk from other users
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp_path, self._path(name))
            temp_path = None
        except OSError as e:
            log.warning("KV store %s: cannot write %s: %s", self, name, e)
        finally:
            if temp_path is not None:
                _remove(temp_path)

    def discard(self, name: str) -> None:
        _remove(self._path(name))

    def close(self) -> None:
        pass

    def _path(self, name: str) -> Path:
        return self.folder / (name + SUFFIX)


def _remove(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("KV store: cannot remove %s: %s", path, e)
