"""What the attention paths' kernels cost on this host, measured once and cached.

The host's cost rule (``mlafx.models.attention_path``) needs each kernel's seconds per
multiply-accumulate at the model's shapes: ``mla_attention_paged`` (the absorbed pass),
``varlen_attention`` (the split's causal MHA over decompressed rows) and ``linear_packed``
over ``kv_b_proj`` (the decompression). They differ by CPU (AMX tiles, AVX-512 BF16, AVX2,
portable), dtype and thread count, so they are timed on the host the engine runs on, the
first time a model of these shapes starts there, and kept as a small JSON file under the
compile cache (``default_cache_dir()/attention_costs``) keyed by all of those and by the
kernels' build. ``mlafx bench attention-path`` prints them with the paths'
measured times at the rule's break-even cases.

The calibration step: one sequence of ``CALIBRATION_TOKENS`` new tokens over as many cached
rows, at most ``CALIBRATION_HEADS`` heads (the rule is per head); well under a second at
DeepSeek's shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mlafx import kernels as K
from mlafx.compile.compiled_step import default_cache_dir
from mlafx.config import ModelConfig
from mlafx.models.attention_path import PathCosts

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 256
CALIBRATION_HEADS = 16
_BLOCK_SIZE = 16
_REPEATS = 7


def attention_path_costs(cfg: ModelConfig, dtype: torch.dtype) -> PathCosts:
    """This host's ``PathCosts`` for ``cfg``'s attention shapes in ``dtype``: read from the
    cache, else measured (and cached)."""
    key = _cache_key(cfg, dtype)
    path = default_cache_dir() / "attention_costs" / f"{_digest(key)}.json"
    cached = _read(path, key)
    if cached is not None:
        return cached
    start = time.perf_counter()
    costs = measure_path_costs(cfg, dtype)
    log.info(
        "attention path costs measured in %.2f s (%s, %s, %d threads): %s",
        time.perf_counter() - start, key["cpu_isa"], key["dtype"], key["threads"], costs,
    )  # fmt: skip
    _write(path, key, costs)
    return costs


def measure_path_costs(cfg: ModelConfig, dtype: torch.dtype) -> PathCosts:
    """Time the three kernels on the calibration step (best of ``_REPEATS``: the least
    disturbed run, as a busy machine only ever adds time)."""
    heads = min(cfg.num_attention_heads, CALIBRATION_HEADS)
    lkv, r, p, v = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    t = c = CALIBRATION_TOKENS
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks = math.ceil((c + t) / _BLOCK_SIZE)
    cache = randn(blocks, _BLOCK_SIZE, lkv + r)
    block_table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    kv_lens = torch.tensor([c + t], dtype=torch.int32)
    starts = torch.tensor([0, t], dtype=torch.int32)
    positions = torch.arange(c, c + t, dtype=torch.int64)
    q_lat = randn(t, heads, lkv + r)
    scale = (p + r) ** -0.5

    def absorbed() -> object:
        return K.mla_attention_paged(
            q_lat, cache, block_table, kv_lens, starts, positions, scale, lkv
        )

    q, k_nope, k_pe, value = (
        randn(t, heads, p + r),
        randn(t, heads, p),
        randn(t, r),
        randn(t, heads, v),
    )

    def decompressed() -> object:
        return K.varlen_attention(q, k_nope, k_pe, value, starts, starts, scale, True)

    latent = randn(t, lkv)
    packed = K.pack_linear_weight(randn(heads * (p + v), lkv))

    def gemm() -> object:
        return K.linear_packed(latent, packed, heads * (p + v))

    pairs = heads * (c * t + t * (t + 1) // 2)  # query/key pairs of the absorbed pass
    return PathCosts(
        absorbed=_best_seconds(absorbed) / (pairs * (2 * lkv + r)),
        decompressed=_best_seconds(decompressed) / (heads * t * (t + 1) // 2 * (p + r + v)),
        gemm=_best_seconds(gemm) / (t * lkv * heads * (p + v)),
    )


def _best_seconds(fn: Callable[[], object]) -> float:
    fn()  # warm-up: first-touch of the outputs and workspaces
    times = []
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _cache_key(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, object]:
    return {
        "cpu_isa": K.cpu_isa(),
        "kernels": K.build_sha256(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "heads": min(cfg.num_attention_heads, CALIBRATION_HEADS),
        "shapes": [cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim],
        "calibration_tokens": CALIBRATION_TOKENS,
    }


def _digest(key: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _read(path: Path, key: dict[str, object]) -> PathCosts | None:
    try:
        record = json.loads(path.read_text())
        if record["key"] == key:
            return PathCosts(**record["costs"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as error:  # a damaged file: measure again
        log.warning("ignoring unreadable attention path costs %s: %s", path, error)
    return None


def _write(path: Path, key: dict[str, object], costs: PathCosts) -> None:
    """Atomically (concurrent engines may measure the same key at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "costs": dataclasses.asdict(costs)}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
        json.dump(record, f, indent=1)
    os.replace(f.name, path)
