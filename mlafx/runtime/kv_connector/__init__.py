"""KV stores that let engines reuse prefixes they never computed (see ``base`` for the
contract). ``make_connector`` turns a spec string into a connector:

    disk:PATH                 safetensors files under PATH (``disk``), the embedded default
    redis://HOST:PORT[/DB]    a Redis server (``redis_store``)

Both keep whole chunks of latent blocks (``chunk_codec``) through one ``StoreConnector``.
A store that cannot be used at all fails here, at start-up, with ``KVConnectorError``.
"""

from __future__ import annotations

from mlafx.runtime.kv_connector.base import (
    DEFAULT_CHUNK_TOKENS,
    KVConnector,
    KVConnectorError,
)
from mlafx.runtime.kv_connector.disk import DiskStore
from mlafx.runtime.kv_connector.redis_store import RedisStore
from mlafx.runtime.kv_connector.store_connector import ChunkStore, StoreConnector

ACCEPTED_FORMS = "disk:PATH or redis://HOST:PORT[/DB]"

__all__ = [
    "ACCEPTED_FORMS",
    "DEFAULT_CHUNK_TOKENS",
    "KVConnector",
    "KVConnectorError",
    "StoreConnector",
    "make_connector",
]


def make_connector(
    spec: str, fingerprint: str, block_size: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> KVConnector:
    """The connector ``spec`` names, namespaced by ``fingerprint`` (``cache_fingerprint``),
    storing chunks of ``chunk_tokens`` tokens (at least one block of ``block_size``).

    Raises ``KVConnectorError`` for an unknown scheme, an empty path, a folder that cannot be
    created or written, or a Redis server that does not answer.
    """
    if block_size < 1 or chunk_tokens < 1:
        raise KVConnectorError(
            f"block_size and chunk_tokens must be positive, got {block_size}, {chunk_tokens}"
        )
    if spec.startswith("disk:"):
        path = spec.removeprefix("disk:")
        if not path:
            raise KVConnectorError(f"KV connector {spec!r} has no path; expected disk:PATH")
        store: ChunkStore = DiskStore(path, fingerprint)
    elif spec.startswith("redis://"):
        store = RedisStore(spec, fingerprint)
    else:
        raise KVConnectorError(f"unknown KV connector {spec!r}; expected {ACCEPTED_FORMS}")
    return StoreConnector(store, fingerprint, block_size, chunk_tokens)
