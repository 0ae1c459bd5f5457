"""Peak RSS of a compiled engine over a GGUF at DeepSeek-V2-Lite's real widths, one MoE layer,
against the GGUF issue's bound (file size x 1.15 + 1 GiB; the KV cache is 64 blocks).

    .venv/bin/python bench/gguf_rss.py [PATH] [--mix q4_0|q4_k_m]   # writes PATH if missing

``q4_0`` (default): every matrix Q4_0. ``q4_k_m``: llama.cpp's Q4_K_M recipe in short: Q6_K for
the output, Q4_K for every matrix whose rows hold whole 256-column super-blocks, and llama.cpp's
fallback Q5_0 for the others (V2-Lite's experts' down rows are 1408 wide); K blocks random valid
ones (``tests/gguf_files.random_k_blocks``).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

# Run as a script, its own folder comes first on sys.path, where bench/kernels.py would shadow
# the `kernels` package transformers probes for; the tests' folder has the GGUF writer.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

V2_LITE_1_LAYER = dict(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    first_k_dense_replace=0,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    topk_method="greedy",
    max_position_embeddings=4096,
)


def write(path: Path, mix: str) -> None:
    """In a child process, so its tensors do not count in the engine's RSS."""
    import torch
    import transformers
    from gguf_files import Q, block_type, write_gguf

    def q4_k_m(name: str, shape: tuple[int, ...]) -> Q:
        if name == "output.weight":
            return Q.Q6_K
        kind = block_type(Q.Q4_K)(name, shape)
        return block_type(Q.Q5_0)(name, shape) if kind == Q.F32 else kind

    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(**V2_LITE_1_LAYER)
    model = transformers.DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).eval()
    write_gguf(path, model, types=q4_k_m if mix == "q4_k_m" else block_type(Q.Q4_0))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?")
    parser.add_argument("--mix", choices=("q4_0", "q4_k_m"), default="q4_0")
    args = parser.parse_args()
    path = Path(args.path or f"/tmp/v2lite_1layer_{args.mix}.gguf")
    if not path.exists():
        if os.fork() == 0:
            write(path, args.mix)
            os._exit(0)
        os.wait()
    import mlafx

    start = time.perf_counter()
    llm = mlafx.LLM(str(path), dtype="bfloat16", num_kv_blocks=64, progress=False)
    load = time.perf_counter() - start
    llm.generate([[5, 6, 7, 8]], mlafx.SamplingParams(max_tokens=4, ignore_eos=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = path.stat().st_size
    print(
        f"file {size / 2**30:.3f} GiB, load + compile {load:.1f} s, peak RSS "
        f"{peak / 2**30:.3f} GiB, bound {size * 1.15 / 2**30 + 1:.3f} GiB"
    )


if __name__ == "__main__":
    main()
