"""A long DeepSeek-V4 prompt served by ``LLM`` in a small cache: the token rows (window rows,
compressor inputs) held only while read (``runtime/token_rows.py``), the pool entries for the
whole context.

``bench/v4_step.py``'s three layers (one sliding, CSA and HCA layer; 16 heads of 512, window
128, CSA 4 with top-512, HCA 128; ``--hidden``), dummy bf16 weights, compiled, block size 64:
one prompt of ``--context`` tokens prefilled in chunks of ``--chunk``, then ``--decode``
tokens. Prints the cache the engine allocated (token and pool blocks) against what keeping every
token's rows would take for the same context, the prefill and decode times and the peak RSS.

    .venv/bin/python bench/v4_long_context.py [--context 32768] [--kv-cache-mib 64]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from bench.v4_step import BLOCK, config, hf_config
from mlafx import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=32)
    args = parser.parse_args()
    cfg = config(args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(hf_config(args.hidden)))
        start = time.perf_counter()
        llm = LLM(
            tmp, load_format="dummy", dtype="bfloat16", block_size=BLOCK, progress=False,
            kv_cache_memory=args.kv_cache_mib << 20, max_num_seqs=1,
            max_num_batched_tokens=args.chunk, max_model_len=args.context + args.decode + 1,
        )  # fmt: skip
        print(f"load + compile {time.perf_counter() - start:.1f} s")
        engine = llm.engine
        assert engine.token_rows is not None
        kinds = list(zip(engine.kv_caches, engine.token_caches, strict=True))
        token_bytes = sum(c.nbytes for c, token in kinds if token)
        pool_bytes = sum(c.nbytes for c, token in kinds if not token)
        per_token_all = sum(c[0].nbytes for c, token in kinds if token) / BLOCK
        per_token_pool = pool_bytes / (engine.blocks.num_blocks * BLOCK)
        print(
            f"cache: {engine.token_rows.num_blocks} token blocks ({token_bytes / 2**20:.1f} MiB) + "
            f"{engine.blocks.num_blocks} pool blocks ({pool_bytes / 2**20:.1f} MiB, "
            f"{engine.blocks.num_blocks * BLOCK} tokens)"
        )
        every = per_token_all + per_token_pool
        print(
            f"every token's rows for {args.context} tokens: {args.context * every / 2**20:.1f} "
            f"MiB ({every:.0f} B a token against {per_token_pool:.0f} B of pools)"
        )
        rng = random.Random(0)
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(args.context)]
        params = SamplingParams(max_tokens=args.decode, ignore_eos=True)
        start = time.perf_counter()
        result = llm.generate([prompt], params)[0]
        total = time.perf_counter() - start
        out, metrics = result.outputs[0], result.metrics
        assert out.finish_reason == "length", out.error
        assert metrics is not None
        ttft, tpot = metrics.time_to_first_token, metrics.time_per_output_token
        print(
            f"prompt {args.context} + {len(out.token_ids)} tokens in {total:.1f} s: first token "
            f"after {ttft:.1f} s, then {tpot * 1e3:.1f} ms a token; "
            f"{engine.stats.num_preemptions} preemptions"
        )
        print(f"token blocks held at the end: {engine.token_rows.num_held}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {rss:.2f} GB")


if __name__ == "__main__":
    main()
