"""``redis://HOST:PORT[/DB]``: chunks as values on a Redis server that engines share.

A chunk's value is its ``chunk_codec`` bytes (safetensors with a checksum), under the Redis
key ``mlafx:<fingerprint>:<key hex>.c<chunk_blocks>``, so engines with another model config,
dtype, block size or cache layout never see each other's entries. A ``SET`` replaces a value
whole, so readers never see part of one. The server may evict or lose entries at will; to
the engine that is a miss. Entries carry no expiry: size the server with ``maxmemory`` and
an eviction policy.

The server must answer a ``PING`` within ``CONNECT_TIMEOUT_S`` at construction
(``KVConnectorError`` otherwise); a failure later (server gone mid-run) is a logged miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mlafx.runtime.kv_connector.base import KVConnectorError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
IO_TIMEOUT_S = 10.0  # one command; a chunk of a large model is a few MB


class RedisStore:
    """A ``ChunkStore`` on the Redis server at ``url`` (``redis://HOST:PORT[/DB]``; a
    password may come as ``redis://:PASSWORD@HOST:PORT``)."""

    def __init__(self, url: str, fingerprint: str) -> None:
        self.url = url
        self.prefix = f"mlafx:{fingerprint}:"
        try:
            self.client = redis.Redis.from_url(
                url,
                socket_connect_timeout=CONNECT_TIMEOUT_S,
                socket_timeout=IO_TIMEOUT_S,
                retry=Retry(NoBackoff(), retries=1),
            )
        except ValueError as e:
            raise KVConnectorError(f"bad Redis URL {url!r}: {e}") from e
        try:
            self.client.ping()
        except redis.RedisError as e:
            self.client.close()
            raise KVConnectorError(f"Redis server at {url} does not answer: {e}") from e

    def __str__(self) -> str:
        return self.url

    def exists(self, names: Sequence[str]) -> list[bool]:
        if not names:
            return []
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.exists(self.prefix + name)
        try:
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as e:
            log.warning("KV store %s: lookup failed: %s", self, e)
            return [False] * len(names)

    def get(self, name: str) -> bytes | None:
        try:
            value = self.client.get(self.prefix + name)
            assert value is None or isinstance(value, bytes)  # a client without decoding
            return value
        except redis.RedisError as e:
            log.warning("KV store %s: cannot read %s: %s", self, name, e)
            return None

    def put(self, name: str, data: bytes) -> None:
        try:
            self.client.set(self.prefix + name, data)
        except redis.RedisError as e:
            log.warning("KV store %s: cannot write %s: %s", self, name, e)

    def discard(self, name: str) -> None:
        try:
            self.client.delete(self.prefix + name)
        except redis.RedisError as e:
            log.warning("KV store %s: cannot delete %s: %s", self, name, e)

    def close(self) -> None:
        self.client.close()
