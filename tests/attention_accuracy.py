"""bf16 attention accuracy against fp64, per case (not a test module; scored and reported as
``tests/bf16_accuracy.py`` describes): ``python -m tests.attention_accuracy``."""

from __future__ import annotations

from mlafx.kernels import batch_invariant_mode, mla_attention_paged, varlen_attention
from mlafx.kernels.attention_reference import mla_attention_paged_ref, varlen_attention_ref
from tests.attention_cases import make_paged, make_varlen
from tests.bf16_accuracy import BF16, errors, report

# name -> (op, builder): vLLM's and SGLang's CPU MLA test shapes (576-wide rows, 512 values,
# 16 and 128 heads, block 16, 256 rows), long split-KV contexts, prefill and odd shapes; the
# paged cases in the default and the batch-invariant mode
PAGED = {
    "vllm_fixed_b4_h16_256": dict(kv_lens=[256] * 4, q_lens=[1] * 4, heads=16, block=16),
    "vllm_varlen_b4_h16": dict(kv_lens=[256, 100, 37, 200], q_lens=[1] * 4, heads=16, block=16),
    "h128_block32": dict(kv_lens=[333, 64], q_lens=[1, 1], heads=128, block=32),
    "split_kv_4096": dict(kv_lens=[4096], q_lens=[1], heads=16, block=16),
    "prefill_with_context": dict(kv_lens=[50, 300], q_lens=[7, 3], heads=16, block=16),
    "odd_block5_h3": dict(kv_lens=[37, 1, 90], q_lens=[1, 1, 2], heads=3, block=5),
    "odd_block1_narrow": dict(kv_lens=[45], q_lens=[1], heads=7, block=1, rank=96, rope=32),
}
VARLEN = {
    "varlen_causal_prefill": dict(q_lens=[9, 33], k_lens=[9, 100], causal=True),
    "varlen_full_long": dict(q_lens=[2], k_lens=[1500], causal=False),
}


def measure() -> dict[str, dict[str, float]]:
    results = {}
    for seed, (name, c) in enumerate(PAGED.items()):
        p = make_paged(
            c["kv_lens"], c["q_lens"], c["heads"], c.get("rank", 512), c.get("rope", 64),
            c["block"], BF16, seed,
        )  # fmt: skip
        args = list(p.args())
        args[0], args[1] = p.q.double(), p.kv_cache.double()
        ref, _ = mla_attention_paged_ref(*args)
        for invariant in (False, True):  # batch-invariant mode has its own cores
            with batch_invariant_mode(invariant):
                out, _ = mla_attention_paged(*p.args())
            results[name + ("/invariant" if invariant else "")] = errors(out, ref)
    for seed, (name, c) in enumerate(VARLEN.items()):
        v = make_varlen(c["q_lens"], c["k_lens"], 16, 128, 64, 128, BF16, c["causal"], seed)
        out, _ = varlen_attention(*v.args())
        args = list(v.args())
        args[:4] = [t.double() for t in args[:4]]
        ref, _ = varlen_attention_ref(*args)
        results[name] = errors(out, ref)
    return results


if __name__ == "__main__":
    report(measure)
