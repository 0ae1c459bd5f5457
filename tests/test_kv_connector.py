"""KV stores (``disk:PATH`` and ``redis://`` against a real redis-server): exact round trips
into other blocks, leading whole chunks only, corrupt or foreign entries as warned misses,
concurrent writers, and start-up errors."""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets

import pytest
import redis
import torch

from mlafx.config import ModelConfig
from mlafx.runtime.block_hash import cache_fingerprint, full_block_hashes
from mlafx.runtime.kv_connector import KVConnectorError, StoreConnector, make_connector
from tests.redis_server import free_port, redis_server
from tests.tiny_models import TINY_OVERRIDES

NUM_LAYERS = 2
WIDTH = 40  # Lkv+R of a made-up model; the stores never look inside a row


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as url:
        yield url


@pytest.fixture(params=["disk", "redis"])
def spec(request, tmp_path) -> str:
    """A store spec; each test gets fresh fingerprints, so tests never share entries."""
    if request.param == "disk":
        return f"disk:{tmp_path / 'store'}"
    return request.getfixturevalue("redis_url")


def new_fingerprint() -> str:
    return secrets.token_hex(32)


def random_caches(
    num_blocks: int, block_size: int, dtype: torch.dtype, seed: int = 0, width: int = WIDTH
):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, width)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(NUM_LAYERS)]


def prompt_keys(num_blocks: int, block_size: int, seed: int = 0) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (num_blocks * block_size,), generator=gen).tolist()
    return full_block_hashes(tokens, block_size)


def block_bytes(caches, block_id: int) -> list[bytes]:
    return [cache[block_id].contiguous().view(torch.uint8).numpy().tobytes() for cache in caches]


def connect(spec: str, fingerprint: str, block_size: int) -> StoreConnector:
    connector = make_connector(spec, fingerprint, block_size)  # chunk_tokens 256
    assert isinstance(connector, StoreConnector)
    return connector


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size, chunk_blocks", [(1, 256), (16, 16), (64, 4)])
def test_round_trip_restores_exact_bytes_into_other_blocks(spec, dtype, block_size, chunk_blocks):
    n = 2 * chunk_blocks + chunk_blocks // 2  # two whole chunks and a partial one
    keys = prompt_keys(n, block_size)
    src = random_caches(2 * n + 1, block_size, dtype)
    perm = torch.randperm(2 * n + 1, generator=torch.Generator().manual_seed(1)).tolist()
    src_ids, dst_ids = perm[:n], perm[n : 2 * n]

    writer = connect(spec, fp := new_fingerprint(), block_size)
    assert writer.chunk_blocks == chunk_blocks
    assert writer.lookup(keys) == 0
    writer.save(keys, src, src_ids)
    writer.close()

    reader = connect(spec, fp, block_size)
    assert reader.lookup(keys) == 2 * chunk_blocks
    dst = [torch.zeros_like(cache) for cache in src]
    assert reader.load(keys, 0, dst, dst_ids) == 2 * chunk_blocks
    for i in range(2 * chunk_blocks):
        assert block_bytes(dst, dst_ids[i]) == block_bytes(src, src_ids[i])
    loaded = set(dst_ids[: 2 * chunk_blocks])
    untouched = [b for b in range(2 * n + 1) if b not in loaded]
    assert all(not cache[untouched].any() for cache in dst)
    reader.close()


def test_lookup_counts_only_leading_whole_chunks(spec):
    block_size, cb = 16, 16
    keys = prompt_keys(3 * cb, block_size)
    caches = random_caches(3 * cb, block_size, torch.float32)
    conn = connect(spec, new_fingerprint(), block_size)

    conn.save(keys[: 2 * cb + 5], caches, list(range(2 * cb + 5)))  # the partial chunk is dropped
    assert conn.lookup(keys) == 2 * cb
    assert conn.lookup(keys[: 2 * cb - 1]) == cb  # chunk 1 is not whole in this prompt
    assert conn.lookup(keys[: cb - 1]) == 0
    other = prompt_keys(2 * cb, block_size, seed=7)
    assert conn.lookup(other) == 0

    conn.store.discard(conn.chunk_names(keys)[0])  # a hole at the start hides what follows
    assert conn.lookup(keys) == 0
    conn.save(keys, caches, list(range(3 * cb)))  # fills chunk 0 and adds chunk 2
    assert conn.lookup(keys) == 3 * cb


@pytest.mark.parametrize("first", [0, 5, 16, 21, 32])
def test_load_from_first_inside_the_stored_run(spec, first):
    block_size, cb = 16, 16
    n = 2 * cb + 3
    keys = prompt_keys(n, block_size)
    src = random_caches(n, block_size, torch.bfloat16)
    conn = connect(spec, new_fingerprint(), block_size)
    conn.save(keys, src, list(range(n)))

    dst = [torch.zeros_like(cache) for cache in src]
    dst_ids = list(range(n - 1, first - 1, -1))  # block keys[first + i] -> block n-1-i
    assert conn.load(keys, first, dst, dst_ids) == 2 * cb - first
    for i, block in enumerate(range(first, 2 * cb)):
        assert block_bytes(dst, dst_ids[i]) == block_bytes(src, block)
    assert not any(cache[dst_ids[2 * cb - first :]].any() for cache in dst)


def test_chunks_saved_one_at_a_time_with_a_block_list_per_cache(spec):
    """DeepSeek-V4's token caches keep their rows in blocks of their own: each cache gets its
    own block ids, and a prompt's chunks are saved as they are computed (``first``). A load
    then fills each cache's own blocks, the same bytes as one list for all."""
    block_size, cb = 16, 16
    n = 2 * cb
    keys = prompt_keys(n, block_size)
    src = random_caches(n + 1, block_size, torch.float32)
    own = [list(range(1, n + 1)), list(range(n, 0, -1))]  # cache 0's blocks, cache 1's
    conn = connect(spec, new_fingerprint(), block_size)
    conn.save(keys[:cb], src, [ids[:cb] for ids in own])
    assert conn.lookup(keys) == cb
    conn.save(keys, src, [ids[cb:] for ids in own], first=cb)
    assert conn.lookup(keys) == n
    dst = [torch.zeros_like(cache) for cache in src]
    assert conn.load(keys, 0, dst, own) == n
    for cache, source, ids in zip(dst, src, own, strict=True):
        assert torch.equal(cache[ids], source[ids]) and not cache[0].any()
    with pytest.raises(ValueError, match="chunk boundary"):
        conn.save(keys, src, [ids[5:] for ids in own], first=5)
    with pytest.raises(ValueError, match="3 block id lists for 2 caches"):
        conn.load(keys, 0, dst, [own[0]] * 3)


def _flip_byte(data: bytes) -> bytes:
    middle = len(data) - 100  # inside the last layer's rows
    return data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :]


CORRUPTIONS = {
    "bit flip": lambda data, other: _flip_byte(data),
    "truncated": lambda data, other: data[: len(data) // 2],
    "empty": lambda data, other: b"",
    "garbage header": lambda data, other: b"\xff" * 16 + data[16:],
    "another chunk's bytes": lambda data, other: other,
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupt_entry_is_a_miss_with_a_warning(spec, corruption, caplog):
    block_size, cb = 16, 16
    keys = prompt_keys(3 * cb, block_size)
    src = random_caches(3 * cb, block_size, torch.float32)
    conn = connect(spec, new_fingerprint(), block_size)
    conn.save(keys, src, list(range(3 * cb)))
    names = conn.chunk_names(keys)
    bad = CORRUPTIONS[corruption](conn.store.get(names[1]), conn.store.get(names[2]))
    conn.store.put(names[1], bad)

    dst = [torch.zeros_like(cache) for cache in src]
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        assert conn.load(keys, 0, dst, list(range(3 * cb))) == cb  # stops before chunk 1
    assert "unusable" in caplog.text
    assert not any(cache[cb:].any() for cache in dst)  # nothing of chunk 1 or 2 written
    assert conn.lookup(keys) == cb  # the bad entry was discarded ...
    conn.save(keys, src, list(range(3 * cb)))  # ... so the next save replaces it
    assert conn.load(keys, 0, dst, list(range(3 * cb))) == 3 * cb
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_a_truncated_file_on_disk_is_a_miss(tmp_path, caplog):
    keys = prompt_keys(16, 16)
    src = random_caches(16, 16, torch.bfloat16)
    conn = connect(f"disk:{tmp_path}", fp := new_fingerprint(), 16)
    conn.save(keys, src, list(range(16)))
    (path,) = (tmp_path / fp).iterdir()
    os.truncate(path, path.stat().st_size - 1)
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        assert conn.load(keys, 0, [torch.zeros_like(c) for c in src], list(range(16))) == 0
    assert "unusable" in caplog.text and not path.exists()


def test_an_overwritten_redis_value_is_a_miss(redis_url, caplog):
    keys = prompt_keys(16, 16)
    src = random_caches(16, 16, torch.bfloat16)
    conn = connect(redis_url, fp := new_fingerprint(), 16)
    conn.save(keys, src, list(range(16)))
    client = redis.Redis.from_url(redis_url)
    (name,) = client.keys(f"mlafx:{fp}:*")
    client.set(name, client.get(name)[:-8] + b"\0" * 8)
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        assert conn.load(keys, 0, [torch.zeros_like(c) for c in src], list(range(16))) == 0
    assert "checksum mismatch" in caplog.text and not client.exists(name)
    client.close()


def test_another_config_dtype_or_block_size_is_a_miss(spec):
    cfg = ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES)
    other_cfg = ModelConfig.from_model("deepseek-v2-lite", {**TINY_OVERRIDES, "kv_lora_rank": 16})
    tokens = list(range(512))
    keys16 = full_block_hashes(tokens, 16)
    src = random_caches(len(keys16), 16, torch.float32)
    connect(spec, cache_fingerprint(cfg, "float32", 16), 16).save(
        keys16, src, list(range(len(keys16)))
    )
    assert connect(spec, cache_fingerprint(cfg, "float32", 16), 16).lookup(keys16) == 32
    assert connect(spec, cache_fingerprint(cfg, "bfloat16", 16), 16).lookup(keys16) == 0
    assert connect(spec, cache_fingerprint(other_cfg, "float32", 16), 16).lookup(keys16) == 0
    keys64 = full_block_hashes(tokens, 64)
    assert connect(spec, cache_fingerprint(cfg, "float32", 64), 64).lookup(keys64) == 0


def test_rows_of_another_dtype_under_the_same_fingerprint_are_a_miss(spec, caplog):
    # a mislabelled store (same fingerprint, other dtype): the chunk's own metadata refuses it
    keys = prompt_keys(16, 16)
    conn = connect(spec, new_fingerprint(), 16)
    conn.save(keys, random_caches(16, 16, torch.bfloat16), list(range(16)))
    dst = random_caches(16, 16, torch.float32, seed=3)
    before = [cache.clone() for cache in dst]
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        assert conn.load(keys, 0, dst, list(range(16))) == 0
    assert "dtype is 'bfloat16', expected 'float32'" in caplog.text
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


CONCURRENT_BLOCKS = 8 * 16  # eight chunks of 16 blocks of 16 tokens


def _concurrent_rows():
    # DeepSeek-sized rows (576 wide), so a chunk file takes a while to write
    return random_caches(CONCURRENT_BLOCKS, 16, torch.bfloat16, width=576)


def _save_worker(root: str, fingerprint: str, barrier, rounds: int) -> None:
    keys = prompt_keys(CONCURRENT_BLOCKS, 16)
    conn = connect(f"disk:{root}", fingerprint, 16)
    barrier.wait()
    conn.save(keys, _concurrent_rows(), list(range(len(keys))))
    chunks = {name: conn.store.get(name) for name in conn.chunk_names(keys)}
    for _ in range(rounds):  # then rewrite every chunk file over and over
        for name, data in chunks.items():
            if data is not None:
                conn.store.put(name, data)


def test_two_processes_writing_one_disk_folder_leave_a_readable_store(tmp_path, caplog):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    fingerprint = new_fingerprint()
    workers = [
        ctx.Process(target=_save_worker, args=(str(tmp_path), fingerprint, barrier, 20))
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    keys = prompt_keys(CONCURRENT_BLOCKS, 16)
    src = _concurrent_rows()
    conn = connect(f"disk:{tmp_path}", fingerprint, 16)
    dst = [torch.zeros_like(cache) for cache in src]
    ids = list(range(CONCURRENT_BLOCKS))
    barrier.wait()
    # a reader racing the writers sees whole chunks or none, never a partial file
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        while any(w.is_alive() for w in workers):
            loaded = conn.load(keys, 0, dst, ids)
            assert all(torch.equal(d[:loaded], s[:loaded]) for d, s in zip(dst, src, strict=True))
    assert "unusable" not in caplog.text
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]

    dst = [torch.zeros_like(cache) for cache in src]
    assert conn.load(keys, 0, dst, ids) == CONCURRENT_BLOCKS
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    files = list((tmp_path / fingerprint).iterdir())
    assert len(files) == 8 and all(f.name.endswith(".c16.safetensors") for f in files)


@pytest.mark.parametrize("bad", ["s3://bucket/x", "disk", "/tmp/store", "redis:/nohost", ""])
def test_an_unknown_scheme_names_the_accepted_forms(bad):
    with pytest.raises(KVConnectorError, match=r"expected disk:PATH or redis://HOST:PORT\[/DB\]"):
        make_connector(bad, new_fingerprint(), 16)


def test_an_empty_disk_path_is_refused():
    with pytest.raises(KVConnectorError, match="has no path"):
        make_connector("disk:", new_fingerprint(), 16)


def test_a_folder_that_cannot_be_created_is_refused(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(KVConnectorError, match="cannot be created or written"):
        make_connector(f"disk:{blocker}/store", new_fingerprint(), 16)


def test_an_unreachable_redis_server_is_refused():
    with pytest.raises(KVConnectorError, match="does not answer"):
        make_connector(f"redis://127.0.0.1:{free_port()}", new_fingerprint(), 16)


def test_a_redis_server_lost_mid_run_is_a_miss(caplog):
    keys = prompt_keys(16, 16)
    caches = random_caches(16, 16, torch.float32)
    with redis_server() as url:
        conn = connect(url, new_fingerprint(), 16)
        conn.save(keys, caches, list(range(16)))
        assert conn.lookup(keys) == 16
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.kv_connector"):
        assert conn.lookup(keys) == 0
        assert conn.load(keys, 0, caches, list(range(16))) == 0
        conn.save(keys, caches, list(range(16)))
    assert "lookup failed" in caplog.text and "cannot read" in caplog.text


def test_mismatched_arguments_are_the_callers_bug(tmp_path):
    conn = connect(f"disk:{tmp_path}", new_fingerprint(), 16)
    keys = prompt_keys(16, 16)
    caches = random_caches(16, 16, torch.float32)
    with pytest.raises(ValueError, match="block ids"):
        conn.save(keys, caches, list(range(15)))
    with pytest.raises(ValueError, match="block ids"):
        conn.load(keys, 4, caches, list(range(16)))
    with pytest.raises(ValueError, match="outside"):
        conn.load(keys, 17, caches, [])
    with pytest.raises(ValueError, match=r"expected \[num_blocks, 16, width\]"):
        conn.save(keys, random_caches(16, 8, torch.float32), list(range(16)))
