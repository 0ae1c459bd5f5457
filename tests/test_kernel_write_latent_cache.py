"""mlafx::write_latent_cache: the C++ kernel against the Python reference, bit for bit.

Bytes are compared exactly (no tolerance): the op only casts, and RNE casts are exact
functions. NaN bytes differ between torch's own code paths, so NaN inputs get their own
test (NaN stays NaN, sign kept) and the bit-exact tests draw NaN-free data.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

from mlafx.kernels import cpu_isa, write_latent_cache
from mlafx.kernels.reference import write_latent_cache_ref

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

# fp32 bit patterns where conversions go wrong: subnormals (VCVTNEPS2BF16 flushes them to 0,
# torch does not), RNE ties to even and odd, overflow to inf, signed zeros, inf, extremes.
_SPECIAL_FP32_BITS = [
    0x00000001, 0x00012345, 0x80012345, 0x007FFFFF, 0x00008000, 0x00018000, 0x807FFFFF,
    0x00800000, 0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF,
    0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x387FC000, 0x00000000, 0x80000000,
    0x7F800000, 0xFF800000, 0x3F800000,
]  # fmt: skip
_NAN_FP32_BITS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FC12345]


def _fp32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _values(shape: tuple[int, int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """NaN-free values: a mix of normal floats, random fp32 bit patterns and special values."""
    n = shape[0] * shape[1]
    normal = torch.randn(n, generator=gen) * 4.0
    any_bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    any_bits = any_bits.to(torch.int32).view(torch.float32)
    special = _fp32_from_bits(_SPECIAL_FP32_BITS)
    special = special[torch.randint(0, len(special), (n,), generator=gen)]
    pick = torch.randint(0, 3, (n,), generator=gen)
    values = torch.where(pick == 0, normal, torch.where(pick == 1, any_bits, special))
    values = values.to(dtype)
    values = torch.where(torch.isnan(values), torch.zeros_like(values), values)
    return values.reshape(shape)


def _garbage_cache(shape: tuple[int, int, int], dtype, gen: torch.Generator) -> torch.Tensor:
    """A cache full of random bytes (NaNs included): untouched rows must keep them."""
    view = _INT_VIEW[dtype]
    info = torch.iinfo(view)
    bits = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return bits.to(view).view(dtype)


def _strided(values: torch.Tensor, layout: str, gen: torch.Generator) -> torch.Tensor:
    """The same values, laid out contiguously or as rows of a wider buffer (stride > width)."""
    if layout == "contiguous":
        return values.contiguous()
    pad = int(torch.randint(1, 9, (1,), generator=gen))
    buffer = torch.zeros(values.shape[0], values.shape[1] + pad, dtype=values.dtype)
    view = buffer[:, pad:]
    view.copy_(values)
    return view


def _assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    view = _INT_VIEW[actual.dtype]
    assert torch.equal(actual.view(view), expected.view(view)), (
        f"{(actual.view(view) != expected.view(view)).sum()} elements differ"
    )


def _run_both(kv_c, k_pe, cache, slots) -> None:
    expected = cache.clone()
    write_latent_cache_ref(kv_c, k_pe, expected, slots)
    write_latent_cache(kv_c, k_pe, cache, slots)
    _assert_same_bytes(cache, expected)


@settings(max_examples=300, deadline=None)
@given(
    num_tokens=st.sampled_from([0, 1, 17]),
    block_size=st.sampled_from([1, 16, 64]),
    widths=st.sampled_from([(512, 64), (45, 19), (16, 16)]),
    kv_dtype=st.sampled_from(FLOAT_DTYPES),
    pe_dtype=st.sampled_from(FLOAT_DTYPES),
    cache_dtype=st.sampled_from(FLOAT_DTYPES),
    layout=st.sampled_from(["contiguous", "strided", "fused"]),
    skip_every=st.sampled_from([0, 1, 3]),
    spare_blocks=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference_bit_exact(
    num_tokens,
    block_size,
    widths,
    kv_dtype,
    pe_dtype,
    cache_dtype,
    layout,
    skip_every,
    spare_blocks,
    seed,
):
    gen = torch.Generator().manual_seed(seed)
    kv_lora_rank, rope_dim = widths
    if layout == "fused":
        # kv_c and k_pe as views of one [T, Lkv + R + pad] buffer, like the kv_a_proj output.
        fused_values = _values((num_tokens, kv_lora_rank + rope_dim), kv_dtype, gen)
        fused = _strided(fused_values, "strided", gen)
        kv_c, k_pe = fused[:, :kv_lora_rank], fused[:, kv_lora_rank:]
    else:
        kv_c = _strided(_values((num_tokens, kv_lora_rank), kv_dtype, gen), layout, gen)
        k_pe = _strided(_values((num_tokens, rope_dim), pe_dtype, gen), layout, gen)
    # Block 0 is reserved (never written), the other blocks come in random order.
    num_blocks = 1 + math.ceil(num_tokens / block_size) + spare_blocks
    free_slots = torch.arange(block_size, num_blocks * block_size)
    slots = free_slots[torch.randperm(len(free_slots), generator=gen)[:num_tokens]]
    if skip_every:
        slots[::skip_every] = -1
    cache = _garbage_cache((num_blocks, block_size, kv_lora_rank + rope_dim), cache_dtype, gen)
    _run_both(kv_c, k_pe, cache, slots)


@pytest.mark.parametrize("cache_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES)
def test_special_values_match_torch(in_dtype, cache_dtype):
    # Deterministic regression test for the conversion edge cases (subnormals above all).
    values = _fp32_from_bits(_SPECIAL_FP32_BITS).to(in_dtype)[None]
    kv_c = values.repeat(1, 3)  # 72 wide: full 16-lane vectors and a masked tail
    k_pe = values.flip(1)
    cache = torch.zeros(2, 1, kv_c.shape[1] + k_pe.shape[1], dtype=cache_dtype)
    write_latent_cache(kv_c, k_pe, cache, torch.tensor([1]))
    expected = torch.cat([kv_c, k_pe], dim=1).to(cache_dtype)[0]
    _assert_same_bytes(cache[1, 0], expected)


@pytest.mark.parametrize("cache_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("in_dtype", FLOAT_DTYPES)
def test_nan_stays_nan(in_dtype, cache_dtype):
    nans = _fp32_from_bits(_NAN_FP32_BITS).to(in_dtype)
    kv_c = torch.cat([nans, torch.ones(13, dtype=in_dtype)])[None].repeat(1, 2)  # crosses 16
    k_pe = nans[None]
    cache = torch.zeros(1, 1, kv_c.shape[1] + k_pe.shape[1], dtype=cache_dtype)
    write_latent_cache(kv_c, k_pe, cache, torch.tensor([0]))
    source = torch.cat([kv_c, k_pe], dim=1)[0]
    row = cache[0, 0]
    assert torch.equal(torch.isnan(row), torch.isnan(source))
    assert torch.equal(torch.signbit(row), torch.signbit(source))
    finite = ~torch.isnan(source)
    _assert_same_bytes(row[finite], source[finite].to(cache_dtype))


@pytest.mark.parametrize(
    ("kv_dtype", "cache_dtype", "num_tokens"),
    [
        (torch.bfloat16, torch.bfloat16, 5),
        (torch.float32, torch.bfloat16, 17),
        (torch.float16, torch.float32, 1),
        (torch.bfloat16, torch.float16, 0),
    ],
)
def test_opcheck(kv_dtype, cache_dtype, num_tokens):
    kv_c = torch.randn(num_tokens, 40, dtype=kv_dtype)
    k_pe = torch.randn(num_tokens, 8, dtype=kv_dtype)
    cache = torch.zeros(5, 4, 48, dtype=cache_dtype)
    slots = torch.randperm(20)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1
    torch.library.opcheck(torch.ops.mlafx.write_latent_cache.default, (kv_c, k_pe, cache, slots))


def test_torch_compile_fullgraph_writes_cache_in_place():
    def step(kv_a: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        kv_c, k_pe = kv_a[:, :24], kv_a[:, 24:]  # strided views, as in the model
        write_latent_cache(kv_c, k_pe, cache, slots)

    kv_a = torch.randn(6, 32)
    slots = torch.tensor([3, -1, 0, 7, 12, 5])
    expected = torch.zeros(4, 4, 32, dtype=torch.bfloat16)
    write_latent_cache_ref(kv_a[:, :24], kv_a[:, 24:], expected, slots)
    cache = torch.zeros_like(expected)
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    _, (code,) = run_and_get_code(compiled, kv_a, cache, slots)
    _assert_same_bytes(cache, expected)
    # Inductor must re-inplace the functionalised op: a copy of the whole cache per layer and
    # step would cost more than the attention itself.
    assert "torch.ops.mlafx.write_latent_cache.default(" in code
    assert "copy_" not in code and "clone" not in code, code


def test_strided_slot_mapping():
    kv_c, k_pe = torch.randn(3, 12), torch.randn(3, 4)
    cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    slots = torch.tensor([6, 0, -1, 9, 2, 0])[::2]  # [6, -1, 2], stride 2
    _run_both(kv_c, k_pe, cache, slots)


# ---- errors: raised before any write ---------------------------------------------------


def _small_inputs(cache_dtype=torch.bfloat16):
    kv_c = torch.randn(3, 12)
    k_pe = torch.randn(3, 4)
    cache = torch.zeros(2, 4, 16, dtype=cache_dtype)
    return kv_c, k_pe, cache


@pytest.mark.parametrize("bad_slot", [8, 1000, -2])
def test_out_of_range_slot_raises_and_writes_nothing(bad_slot):
    kv_c, k_pe, cache = _small_inputs()
    slots = torch.tensor([0, 5, bad_slot])  # the valid slots come first: still not written
    before = cache.clone()
    with pytest.raises(IndexError, match=rf"slot_mapping\[2\] = {bad_slot} is out of range"):
        write_latent_cache(kv_c, k_pe, cache, slots)
    _assert_same_bytes(cache, before)
    with pytest.raises(IndexError):
        write_latent_cache_ref(kv_c, k_pe, cache, slots)
    _assert_same_bytes(cache, before)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("slots_int32", TypeError, "slot_mapping must be int64"),
        ("kv_c_float64", TypeError, "must be bfloat16, float16 or float32"),
        ("cache_int8", TypeError, "must be bfloat16, float16 or float32"),
        ("cache_too_wide", ValueError, "kv_cache rows are 17 wide"),
        ("k_pe_too_narrow", ValueError, r"kv_c \(12\) \+ k_pe \(3\)"),
        ("token_count", ValueError, "same number of tokens"),
        ("kv_c_last_dim_strided", ValueError, "kv_c's last dim must be contiguous"),
        ("cache_not_contiguous", ValueError, "kv_cache must be contiguous"),
        ("cache_2d", ValueError, "kv_cache must be"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    kv_c, k_pe, cache = _small_inputs()
    slots = torch.tensor([0, 1, 2])
    if change == "slots_int32":
        slots = slots.to(torch.int32)
    elif change == "kv_c_float64":
        kv_c = kv_c.double()
    elif change == "cache_int8":
        cache = torch.zeros(2, 4, 16, dtype=torch.int8)
    elif change == "cache_too_wide":
        cache = torch.zeros(2, 4, 17, dtype=torch.bfloat16)
    elif change == "k_pe_too_narrow":
        k_pe = k_pe[:, :3]
    elif change == "token_count":
        kv_c = kv_c[:2]
    elif change == "kv_c_last_dim_strided":
        kv_c = torch.randn(3, 24)[:, ::2]
    elif change == "cache_not_contiguous":
        cache = torch.zeros(4, 2, 16, dtype=torch.bfloat16).transpose(0, 1)
    elif change == "cache_2d":
        cache = cache.view(8, 16)
    before = cache.clone()
    with pytest.raises(error, match=match):
        write_latent_cache(kv_c, k_pe, cache, slots)
    assert torch.equal(cache, before)


# ---- ISA dispatch -----------------------------------------------------------------------


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"))


_AVX512_DISABLED = os.environ.get("MLAFX_DISABLE_AVX512", "") not in ("", "0")


@pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="CPU lacks AVX-512 BF16")
@pytest.mark.skipif(_AVX512_DISABLED, reason="MLAFX_DISABLE_AVX512 is set for this run")
def test_avx512_path_is_active_when_supported():
    assert cpu_isa() in ("avx512_bf16", "avx512_amx")


# Runs in this process and in a child with MLAFX_DISABLE_AVX512=1; the bytes must agree.
_PROBE = """
import torch
from mlafx.kernels import cpu_isa, write_latent_cache

def probe():
    gen = torch.Generator().manual_seed(0)
    bits = [0x00012345, 0x80012345, 0x007FFFFF, 0x3F808000, 0x3F818000, 0x7F7FFFFF,
            0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC12345, 0x7F800000]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    results = {}
    for in_dtype in (torch.float32, torch.float16, torch.bfloat16):
        for cache_dtype in (torch.float32, torch.float16, torch.bfloat16):
            kv_c = torch.randn(9, 45, generator=gen).to(in_dtype)
            kv_c[:, :12] = special.to(in_dtype)
            k_pe = torch.randn(9, 19, generator=gen).to(in_dtype)
            cache = torch.zeros(4, 4, 64, dtype=cache_dtype)
            slots = torch.tensor([3, -1, 0, 15, 7, 9, 1, 12, 4])
            write_latent_cache(kv_c, k_pe, cache, slots)
            results[f"{in_dtype}->{cache_dtype}"] = cache
    return cpu_isa(), results
"""


def test_portable_path_gives_identical_bytes(tmp_path):
    namespace: dict = {}
    exec(_PROBE, namespace)
    here_isa, here = namespace["probe"]()
    out = tmp_path / "portable.pt"
    child = _PROBE + "\nimport sys\ntorch.save(probe(), sys.argv[1])\n"
    env = {**os.environ, "MLAFX_DISABLE_AVX512": "1"}
    subprocess.run([sys.executable, "-c", child, str(out)], env=env, check=True, timeout=120)
    child_isa, there = torch.load(out)
    assert child_isa == "portable"
    assert here.keys() == there.keys()
    for key in here:
        _assert_same_bytes(there[key], here[key])
    if _cpu_has_avx512_bf16() and not _AVX512_DISABLED:
        # So the comparison above really covered both paths.
        assert here_isa in ("avx512_bf16", "avx512_amx")
