"""One engine in its own process for the cross-process KV-store test: the tiny fp32 model
(reference path, block size 16) serves one prompt through ``kv_connector=SPEC`` and prints
its greedy tokens and hit counts as JSON.

    python -m tests.kv_engine_worker SPEC TOKEN_IDS_COMMA_SEPARATED
"""

from __future__ import annotations

import json
import sys

import mlafx
from tests.tiny_models import tiny_llm

GREEDY = mlafx.SamplingParams(max_tokens=8, ignore_eos=True)


def serve(spec: str, prompt: list[int], **engine_options) -> dict:
    """Greedy tokens, ``num_cached_tokens`` and ``external_hit_tokens`` of one fresh engine."""
    options = dict(block_size=16, num_kv_blocks=64, kv_connector=spec) | engine_options
    llm = tiny_llm(**options)
    try:
        (out,) = llm.generate([prompt], GREEDY)
        return {
            "tokens": out.outputs[0].token_ids,
            "num_cached_tokens": out.num_cached_tokens,
            "external_hit_tokens": llm.get_metrics()["external_hit_tokens"],
        }
    finally:
        llm.close()


if __name__ == "__main__":
    spec, token_ids = sys.argv[1], sys.argv[2]
    print(json.dumps(serve(spec, [int(t) for t in token_ids.split(",")])))
