"""DeepSeek-V4's step, compiled (``compile/v4_compiled_step.py``) against the same step run
eagerly on the same ops (the reference model with the sparse metadata: what ``compile=False``
serves), on dummy bf16 weights.

A few layers of one of each type (sliding, CSA, HCA; routed MoE, the first hash MoE), V4's
attention shapes at a smaller hidden size (``--hidden``, default 1024; 16 heads of 512, window
128, CSA 4 with top-512, HCA 128), block size 64. Cases: decode at batch 1 and 8 after
``--context`` cached tokens (caches filled with random rows: the time does not depend on their
values), and one 512-token prefill chunk after the same context. Medians of ``--repeat``
alternated runs, with the peak RSS of the process.

    .venv/bin/python bench/v4_step.py [--context 32768] [--hidden 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from mlafx.compile.v4_compiled_step import compile_v4_step
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.build import build_deepseek_v4
from mlafx.models.deepseek_v4.model import cache_shapes
from mlafx.models.deepseek_v4.step import SequenceStep, v4_step_metadata

BLOCK = 64


def hf_config(hidden: int) -> dict:
    """The model's config.json (transformers' keys)."""
    return dict(
        model_type="deepseek_v4",
        vocab_size=32000,
        hidden_size=hidden,
        num_hidden_layers=3,
        num_attention_heads=16,
        head_dim=512,
        q_lora_rank=512,
        qk_rope_head_dim=64,
        o_groups=4,
        o_lora_rank=512,
        moe_intermediate_size=512,
        n_routed_experts=16,
        num_experts_per_tok=4,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=128,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        max_position_embeddings=1 << 20,
    )


def config(hidden: int) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf_dict(hf_config(hidden))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cfg = config(args.hidden)
    model = build_deepseek_v4(cfg, torch.bfloat16, None)
    start = time.perf_counter()
    compiled = compile_v4_step(model, BLOCK)
    print(f"compile (or cache load) {time.perf_counter() - start:.1f} s")

    batch, ctx = 8, args.context
    per_seq = -(-(ctx + 512) // BLOCK)
    caches = [
        torch.empty(s, dtype=torch.bfloat16).normal_()
        for s in cache_shapes(cfg, 1 + batch * per_seq, BLOCK)
    ]
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]

    def step(seqs: list[SequenceStep]):  # type: ignore[no-untyped-def]
        meta = v4_step_metadata(seqs, BLOCK, cfg.sliding_window, cfg.compress_rates, sparse=True)
        tokens = sum(s.new_tokens for s in seqs)
        ids = torch.randint(0, cfg.vocab_size, (tokens,))
        last = torch.tensor([s.new_tokens for s in seqs]).cumsum(0) - 1
        return ids, meta, last

    cases = {
        "decode b1": [SequenceStep(ctx, 1, tables[0])],
        "decode b8": [SequenceStep(ctx, 1, t) for t in tables],
        "prefill 512": [SequenceStep(ctx, 512, tables[0])],
    }
    runs = {
        "eager (ops)": lambda ids, meta, last: model(ids, caches, meta, last),
        "compiled": lambda ids, meta, last: compiled.run(ids, caches, meta, last),
    }
    print(f"context {ctx}, hidden {cfg.hidden_size}, 3 layers, block {BLOCK}")
    for name, seqs in cases.items():
        times: dict[str, list[float]] = {k: [] for k in runs}
        with torch.no_grad():
            for _ in range(args.repeat + 1):  # the first round warms up
                for run_name, run in runs.items():
                    inputs = step(seqs)
                    t0 = time.perf_counter()
                    run(*inputs)
                    times[run_name].append(time.perf_counter() - t0)
        med = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}
        ratio = med["eager (ops)"] / med["compiled"]
        line = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
        print(f"{name:12s} {line}  ({ratio:.2f}x)")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()
