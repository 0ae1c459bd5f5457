"""A checkpoint's ``quantization_config``: the published quantized formats mlafx serves from
their own bytes, read and checked before any weight is.

- ``PackedInt4``: compressed-tensors ``pack-quantized`` int4 (Kimi K2-Thinking/K2.5/K2.6 and
  community quants): symmetric integer weights in [-8, 7], one scale per group of
  ``group_size`` columns (or per output channel), stored as ``<module>.weight_packed`` int32
  ``[out, ceil(in/8)]`` (eight 4-bit values ``v + 8`` per int32, element j in bits 4j..4j+3),
  ``<module>.weight_scale`` ``[out, in/group]`` and ``<module>.weight_shape`` ``[2]``.
  Modules the ``ignore`` list names stay in the model dtype. They repack losslessly into
  mlafx's int4 layout (``kernels/quant_format.py``: ``w = d * (q - 8)`` per 32 columns, an fp16
  ``d``), so they run on the same kernels as ``quantization="int4"``.
- ``BlockFp8``: DeepSeek's block-scaled FP8 (``quant_method: fp8``, e4m3, a float32
  ``weight_scale_inv`` per ``weight_block_size`` block): served from its own bytes
  (``kernels/fp8_format.py``); the block's columns must be a multiple of 32.

Anything else (another method, bits, asymmetric zero points, activation quantization, a group
the layout cannot take) is one ``ConfigError`` naming the key and value and what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mlafx.config.model_config import ConfigError

_SUPPORTED = (
    "mlafx serves quant_method 'fp8' (e4m3, dynamic activations, weight_block_size [rows, "
    "cols a multiple of 32]) and 'compressed-tensors' (format 'pack-quantized': int4, "
    "symmetric, group_size a multiple of 32 or per channel, weights only)"
)
_FP8_K_STEP = 32  # kernels/fp8_format.K_STEP (config/ imports no kernels)
# mlafx's int4 layout has one scale per 32 columns: a coarser group repeats its scale.
_GROUP = 32


@dataclass(frozen=True)
class PackedInt4:
    """compressed-tensors pack-quantized int4 weights (see the module docstring)."""

    group_size: int | None  # None: one scale per output channel
    ignore: tuple[str, ...] = ()  # module names, or "re:<pattern>" (re.match on the name)

    def ignores(self, module_name: str) -> bool:
        """Whether the checkpoint keeps ``module_name`` unquantized (compressed-tensors' rule:
        an exact name, or a ``re:`` pattern matched at the start of the name)."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif entry == module_name:
                return True
        return False


@dataclass(frozen=True)
class BlockFp8:
    """DeepSeek's block-scaled FP8: e4m3 weights, a float32 scale per ``block`` (rows, cols)."""

    block: tuple[int, int]


StoredQuantization = PackedInt4 | BlockFp8


def _fail(key: str, value: Any, why: str = "") -> ConfigError:
    because = f" ({why})" if why else ""
    return ConfigError(
        f"quantization_config.{key} = {value!r} is not supported{because}; {_SUPPORTED}"
    )


def stored_quantization(raw: dict[str, Any]) -> StoredQuantization | None:
    """The format announced by config dict ``raw`` (its ``quantization_config``, at the top or
    in ``text_config``), or None for an unquantized checkpoint."""
    qc = raw.get("quantization_config")
    text = raw.get("text_config")
    if qc is None and isinstance(text, dict):
        qc = text.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _packed_int4(qc)
    if method == "fp8":
        return _block_fp8(qc)
    raise _fail("quant_method", method)


def _block_fp8(qc: dict[str, Any]) -> BlockFp8:
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _fail("fmt", fmt, "FP8 checkpoints must be e4m3")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _fail("activation_scheme", scheme, "static activation scales")
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise _fail("weight_block_size", block, "FP8 needs a [rows, cols] block of positive ints")
    if block[1] % _FP8_K_STEP:
        raise _fail("weight_block_size", block, f"the columns must be a multiple of {_FP8_K_STEP}")
    return BlockFp8(block=(block[0], block[1]))


def _packed_int4(qc: dict[str, Any]) -> PackedInt4:
    fmt = qc.get("format")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail("quantization_status", status, "the weights are not stored compressed")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail("config_groups", groups, "no quantization scheme")
    if qc.get("kv_cache_scheme") is not None:
        raise _fail("kv_cache_scheme", qc["kv_cache_scheme"], "a quantized KV cache")
    group_sizes = set()
    for name, scheme in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(scheme, dict):
            raise _fail(where, scheme)
        scheme_format = scheme.get("format") or fmt
        if scheme_format != "pack-quantized":
            raise _fail(f"{where}.format" if scheme.get("format") else "format", scheme_format)
        for side in ("input_activations", "output_activations"):
            if scheme.get(side) is not None:
                raise _fail(f"{where}.{side}", scheme[side], "activation quantization")
        weights = scheme.get("weights")
        if not isinstance(weights, dict):
            raise _fail(f"{where}.weights", weights)
        group_sizes.add(_int4_weights(weights, f"{where}.weights"))
    if len(group_sizes) != 1:
        raise _fail("config_groups", sorted(group_sizes, key=str), "groups of different sizes")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise _fail("ignore", ignore, "a list of module names and 're:' patterns")
    return PackedInt4(group_size=group_sizes.pop(), ignore=tuple(ignore))


def _int4_weights(weights: dict[str, Any], where: str) -> int | None:
    """The group size (None: per channel) of one scheme's ``weights``, checked."""
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False}
    for key, want in expected.items():
        value = weights.get(key, want if key == "dynamic" else None)
        if value != want:
            raise _fail(f"{where}.{key}", value)
    if weights.get("actorder") not in (None, "weight", "static"):
        raise _fail(f"{where}.actorder", weights["actorder"], "a stored column permutation")
    if weights.get("block_structure") is not None:
        raise _fail(f"{where}.block_structure", weights["block_structure"])
    strategy = weights.get("strategy")
    if strategy == "channel":
        return None
    if strategy != "group":
        raise _fail(f"{where}.strategy", strategy)
    size = weights.get("group_size")
    if not isinstance(size, int) or size <= 0 or size % _GROUP:
        raise _fail(f"{where}.group_size", size, f"a multiple of {_GROUP}")
    return size
