"""The attention ops as torch.library ops: opcheck, torch.compile, torch.export, input errors,
and the portable path (a child process with MLAFX_DISABLE_AVX512=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_cases import make_paged, make_varlen
from cpu_flags import has_avx2

from mlafx.kernels import (
    cpu_isa,
    gather_latent,
    merge_attn_states,
    mla_attention_paged,
    varlen_attention,
)

OPS = torch.ops.mlafx


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_mla_attention_paged(dtype):
    inputs = make_paged([20, 0, 5], [2, 1, 1], 3, 24, 8, 8, dtype, seed=0)
    torch.library.opcheck(OPS.mla_attention_paged.default, inputs.args())


@pytest.mark.parametrize("causal", [True, False])
def test_opcheck_varlen_attention(causal):
    inputs = make_varlen([5, 0, 3], [5, 2, 7], 2, 8, 4, 6, torch.bfloat16, causal, seed=0)
    torch.library.opcheck(OPS.varlen_attention.default, inputs.args())


def test_opcheck_merge_and_gather():
    out = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    lse = torch.randn(2, 5)
    torch.library.opcheck(OPS.merge_attn_states.default, (out, lse, out.flip(0), lse.flip(1)))
    cache = torch.randn(3, 4, 10, dtype=torch.float16)
    torch.library.opcheck(OPS.gather_latent.default, (cache, torch.tensor([11, 0, 4])))


def test_torch_compile_fullgraph():
    inputs = make_paged([9, 30], [1, 2], 2, 16, 8, 4, torch.float32, seed=1)

    def step(q, cache, table, lens, qsl, pos, suffix_out, suffix_lse):
        out, lse = mla_attention_paged(q, cache, table, lens, qsl, pos, 0.3, 16)
        return merge_attn_states(out * 2, lse, suffix_out, suffix_lse)

    args = (*inputs.args()[:6], torch.randn(3, 2, 16), torch.randn(2, 3))
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    expected = step(*args)
    actual = compiled(*args)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)


def test_torch_export():
    class Module(torch.nn.Module):
        def forward(self, q, k_nope, k_pe, v, cu_q, cu_k, cache, slots):
            out, lse = varlen_attention(q, k_nope, k_pe, v, cu_q, cu_k, 0.25, True)
            return out, lse, gather_latent(cache, slots)

    inputs = make_varlen([4, 3], [4, 6], 2, 8, 4, 6, torch.float32, True, seed=2)
    cache = torch.randn(3, 4, 12)
    args = (*inputs.args()[:6], cache, torch.tensor([5, 1]))
    exported = torch.export.export(Module(), args)
    for a, e in zip(exported.module()(*args), Module()(*args), strict=True):
        torch.testing.assert_close(a, e)


# ---- input errors: raised before any read of the cache ----------------------------------------


def _paged_args(**changes):
    inputs = make_paged([20, 5], [1, 1], 2, 16, 8, 8, torch.bfloat16, seed=3)
    args = dict(zip(
        ["q", "kv_cache", "block_table", "kv_lens", "query_start_loc", "positions", "scale",
         "kv_lora_rank"], inputs.args(), strict=True))  # fmt: skip
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("bad_block", IndexError, r"block_table\[0, 1\] = 99 is out of range for a cache of"),
        ("negative_block", IndexError, r"block_table\[1, 0\] = -3 is out of range"),
        (
            "kv_len_too_long",
            ValueError,
            r"kv_lens\[0\] = 1000 is out of range 0..32 \(block_table width 4",
        ),
        ("negative_kv_len", ValueError, r"kv_lens\[1\] = -1 is out of range"),
        ("qsl_total", ValueError, r"query_start_loc\[-1\] = 3 must equal num_tokens = 2"),
        ("qsl_decreasing", ValueError, "must be non-decreasing"),
        ("table_int64", TypeError, "block_table must be int32"),
        ("positions_int32", TypeError, "positions must be int64"),
        ("cache_dtype", TypeError, "kv_cache must have q's dtype"),
        ("q_float64", TypeError, "q must be bfloat16, float16 or float32"),
        ("width", ValueError, "kv_cache rows are 25 wide but q rows are 24"),
        ("rank", ValueError, "kv_lora_rank = 30 must be in 1..24"),
        ("q_last_dim_strided", ValueError, "q's last dim must be contiguous"),
        ("cache_not_contiguous", ValueError, "kv_cache must be contiguous"),
        ("num_seqs", ValueError, "kv_lens has 1 entries but block_table has 2 rows"),
    ],
)
def test_paged_invalid_inputs_raise(change, error, match):
    args = _paged_args()
    if change == "bad_block":
        args["block_table"][0, 1] = 99
    elif change == "negative_block":
        args["block_table"][1, 0] = -3
    elif change == "kv_len_too_long":
        args["kv_lens"][0] = 1000
    elif change == "negative_kv_len":
        args["kv_lens"][1] = -1
    elif change == "qsl_total":
        args["query_start_loc"] = torch.tensor([0, 1, 3], dtype=torch.int32)
    elif change == "qsl_decreasing":
        args["query_start_loc"] = torch.tensor([0, 2, 1], dtype=torch.int32)
    elif change == "table_int64":
        args["block_table"] = args["block_table"].long()
    elif change == "positions_int32":
        args["positions"] = args["positions"].int()
    elif change == "cache_dtype":
        args["kv_cache"] = args["kv_cache"].float()
    elif change == "q_float64":
        args["q"] = args["q"].double()
        args["kv_cache"] = args["kv_cache"].double()
    elif change == "width":
        args["kv_cache"] = torch.zeros(*args["kv_cache"].shape[:2], 25, dtype=torch.bfloat16)
    elif change == "rank":
        args["kv_lora_rank"] = 30
    elif change == "q_last_dim_strided":
        args["q"] = torch.zeros(2, 2, 48, dtype=torch.bfloat16)[..., ::2]
    elif change == "cache_not_contiguous":
        args["kv_cache"] = args["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)
    elif change == "num_seqs":
        args["kv_lens"] = args["kv_lens"][:1]
    with pytest.raises(error, match=match):
        mla_attention_paged(**args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("cu_k_total", ValueError, r"cu_seqlens_k\[-1\] = 8 must equal num_keys"),
        ("cu_q_start", ValueError, r"cu_seqlens_q\[0\] must be 0"),
        ("cu_lengths", ValueError, "both have num_seqs \\+ 1"),
        ("cu_int64", TypeError, "cu_seqlens_q must be int32"),
        ("widths", ValueError, r"q rows are 12 wide but P \(8\) \+ R \(3\) is 11"),
        ("heads", ValueError, "k_nope and v must have 2 heads"),
        ("dtypes", TypeError, "must have one dtype"),
        ("v_strided", ValueError, "v's last dim must be contiguous"),
    ],
)
def test_varlen_invalid_inputs_raise(change, error, match):
    x = make_varlen([4, 3], [4, 5], 2, 8, 4, 6, torch.float32, True, seed=4)
    q, k_nope, k_pe, v, cu_q, cu_k = x.q, x.k_nope, x.k_pe, x.v, x.cu_seqlens_q, x.cu_seqlens_k
    if change == "cu_k_total":
        cu_k = torch.tensor([0, 4, 8], dtype=torch.int32)
    elif change == "cu_q_start":
        cu_q = torch.tensor([1, 4, 7], dtype=torch.int32)
    elif change == "cu_lengths":
        cu_k = cu_k[:2]
    elif change == "cu_int64":
        cu_q = cu_q.long()
    elif change == "widths":
        k_pe = k_pe[:, :3]
    elif change == "heads":
        v = v[:, :1]
    elif change == "dtypes":
        v = v.bfloat16()
    elif change == "v_strided":
        v = torch.zeros(9, 2, 12)[..., ::2]
    with pytest.raises(error, match=match):
        varlen_attention(q, k_nope, k_pe, v, cu_q, cu_k, 0.3, True)


# ---- the portable path --------------------------------------------------------------------------

_AVX512_DISABLED = os.environ.get("MLAFX_DISABLE_AVX512", "") not in ("", "0")

# Representative tests (every op, every dtype, odd widths, splits) rerun in a child process.
_PORTABLE_SUBSET = [
    "tests/test_kernel_attention.py::test_fixed_paged_decode_deepseek_shapes",
    "tests/test_kernel_attention.py::test_fixed_paged_prefill_many_queries_and_heads",
    "tests/test_kernel_attention.py::test_fixed_paged_no_visible_key_gives_zero_and_neg_inf",
    "tests/test_kernel_attention.py::test_fixed_varlen_causal_prefill",
    "tests/test_kernel_attention.py::test_fixed_varlen_leading_rows_without_keys",
    "tests/test_kernel_attention.py::test_fixed_varlen_long_single_query_is_split",
    "tests/test_kernel_attention.py::test_split_context_plus_suffix_equals_one_pass",
    "tests/test_kernel_attn_merge_gather.py::test_merge_empty_halves_and_nan",
    "tests/test_kernel_attn_merge_gather.py::test_merge_matches_reference",
    "tests/test_kernel_attention_ops.py::test_portable_path_is_active",
]


def test_portable_path_is_active():
    expected = "portable" if _AVX512_DISABLED else cpu_isa()
    assert cpu_isa() == expected
    if os.environ.get("MLAFX_AVX2_ONLY", "") not in ("", "0"):
        assert cpu_isa() == ("avx2" if has_avx2() else "portable")


def _run_subset_in_child(env_overrides: dict[str, str]) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, **env_overrides}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_PORTABLE_SUBSET],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout


@pytest.mark.skipif(_AVX512_DISABLED, reason="this run already uses the portable path")
def test_portable_path_passes_subset():
    _run_subset_in_child({"MLAFX_DISABLE_AVX512": "1"})


@pytest.mark.skipif(cpu_isa() != "avx512_amx", reason="this run does not use the AMX core")
def test_avx512_path_without_tiles_passes_subset():
    # On an AMX machine the bf16 attention ops run on tiles; the AVX-512 core is what CPUs
    # without AMX run, so it gets the same subset.
    _run_subset_in_child({"MLAFX_DISABLE_AMX": "1"})


@pytest.mark.skipif(
    not (cpu_isa().startswith("avx512") and has_avx2()),
    reason="this run already uses the AVX2 core (or the CPU lacks it)",
)
def test_avx2_path_passes_subset():
    # On an AVX-512 machine the AVX2 core is what CPUs without AVX-512 run.
    _run_subset_in_child({"MLAFX_AVX2_ONLY": "1"})


def test_vectorised_and_portable_agree_on_deepseek_decode(tmp_path):
    # The two paths against each other (not only each against the reference).
    script = (
        "import sys, torch\n"
        "sys.path.insert(0, 'tests')\n"
        "from attention_cases import make_paged\n"
        "from mlafx.kernels import mla_attention_paged, cpu_isa\n"
        "i = make_paged([300, 17], [1, 1], 16, 512, 64, 16, torch.bfloat16, seed=5)\n"
        "torch.save((cpu_isa(), mla_attention_paged(*i.args())), sys.argv[1])\n"
    )
    root = Path(__file__).resolve().parents[1]
    outs = {}
    paths = {
        "default": {},
        "no-amx": {"MLAFX_DISABLE_AMX": "1"},
        "portable": {"MLAFX_DISABLE_AVX512": "1"},
    }
    for name, overrides in paths.items():
        path = tmp_path / f"{name}.pt"
        env = {**os.environ, "MLAFX_DISABLE_AVX512": "0", "MLAFX_DISABLE_AMX": "0", **overrides}
        subprocess.run(
            [sys.executable, "-c", script, str(path)], cwd=root, env=env, check=True, timeout=120
        )
        outs[name] = torch.load(path)
    assert outs["portable"][0] == "portable"
    assert outs["no-amx"][0] in ("avx512_bf16", "avx2", "portable")
    out_p, lse_p = outs["portable"][1]
    for name in ("default", "no-amx"):
        out_v, lse_v = outs[name][1]
        torch.testing.assert_close(lse_v, lse_p, atol=1e-3, rtol=0)
        torch.testing.assert_close(out_v.float(), out_p.float(), atol=1.5e-2, rtol=1.5e-2)
