"""Quantized weights: bytes, accuracy against bf16, and speed, per format.

    .venv/bin/mlafx bench quant [--layers 2] [--experts 16] [--prompts 8] [--prompt-len 128]
                                [--no-speed] [--json FILE]

accuracy  DeepSeek-V2-Lite at its real widths (``--layers`` layers, ``--experts`` routed
          experts, bf16, dummy weights), on two weight sets: ``random`` (the dummy draws: nearly
          flat, easy) and ``structured`` (as trained LLMs have: log-normal row scales, 1% of
          input channels 8-16x larger, 0.1% of weights 8x outliers, and a few hidden channels
          whose norm weights are 8x, which gives activations outlier channels). Per format:
          the weights' bytes, the mean KL divergence KL(bf16 || format) of the next-token
          distributions over every position of ``--prompts`` fixed random prompts of
          ``--prompt-len`` tokens (teacher-forced, one prefill each), and top-1 agreement.
          Formats: ours (int8, int4) and llama.cpp's Q8_0 and Q4_0, made by the ``gguf``
          package's quantizers and repacked without loss into our layout, so they run with
          the same kernels and W8A8 arithmetic (llama.cpp's own Q8_0 activations have an fp16
          scale, ours fp32).
speed     bf16, int8 and int4 engines (compiled, 2 threads unless ``--threads``), each in a
          fresh process: decode ms/step at batch 1 and 8 (64 new tokens after a 128-token
          prompt), prefill of one 1024-token prompt, and peak RSS.
The eager models run the quantized kernels (``kernels_as_custom_ops``); bf16 linears run
``F.linear``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("int8", "int4", "q8_0", "q4_0")


def bench_config(layers: int, experts: int):
    from mlafx.config import ModelConfig

    overrides = {"num_hidden_layers": layers, "n_routed_experts": experts}
    if experts < 64:
        overrides.update(n_group=1, topk_group=1)
    return ModelConfig.from_model("deepseek-v2-lite", overrides)


def structure_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Give the dummy weights the structure of trained ones (see the module docstring)."""
    from mlafx.models.quantized import quantization_targets

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in quantization_targets(model):
            owner, _, leaf = name.rpartition(".")
            w = getattr(model.get_submodule(owner), leaf)
            rows, cols = w.shape[-2], w.shape[-1]
            row_scale = torch.exp(0.5 * torch.randn(*w.shape[:-1], 1, generator=g))
            col_scale = torch.ones(cols)
            outliers = torch.randperm(cols, generator=g)[: max(1, cols // 100)]
            col_scale[outliers] = 8 + 8 * torch.rand(len(outliers), generator=g)
            for part in w.view(-1, rows, cols):
                spikes = torch.rand(rows, cols, generator=g) < 1e-3
                scaled = part.float() * col_scale * torch.where(spikes, 8.0, 1.0)
                part.copy_(scaled)
            w.mul_(row_scale.to(w.dtype))
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                channels = torch.randperm(norm.weight.numel(), generator=g)[:4]
                norm.weight[channels] = 8.0


def ggml_quantize(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """llama.cpp's Q8_0 / Q4_0 of ``weight`` [N, K] (``gguf`` package), repacked into ours."""
    import gguf

    from mlafx.kernels.quant_format import repack_ggml_q4_0, repack_ggml_q8_0

    kind = gguf.GGMLQuantizationType.Q8_0 if bits == 8 else gguf.GGMLQuantizationType.Q4_0
    n, k = weight.shape
    blocks = gguf.quants.quantize(weight.float().numpy(), kind)
    raw = torch.from_numpy(blocks.reshape(n, -1))
    return (repack_ggml_q8_0 if bits == 8 else repack_ggml_q4_0)(raw, n, k)


def quantized_copy(cfg, weights: str, fmt: str):
    """The bf16 model of ``weights``, then ``fmt``-quantized target by target."""
    import mlafx.models.quantized as quantized
    from mlafx.models.loader import build_model

    model = build_model(cfg, "bfloat16", "dummy", seed=0, progress=False)
    if weights == "structured":
        structure_weights(model)
    if fmt == "bf16":
        return model
    ours = {"q8_0": "int8", "q4_0": "int4"}.get(fmt, fmt)
    quantizer = quantized.Quantizer(model, ours)
    original = quantized.quantize_weight
    quantize = ggml_quantize if fmt.startswith("q") else original
    errors = model.weight_errors = [0.0, 0.0]  # sum of squared errors, of squared weights

    def measured(weight: torch.Tensor, bits: int) -> torch.Tensor:
        from mlafx.kernels.quant_format import dequantize_weight

        packed = quantize(weight, bits)
        w = weight.float()
        errors[0] += float((dequantize_weight(packed, *w.shape) - w).pow(2).sum())
        errors[1] += float(w.pow(2).sum())
        return packed

    quantized.quantize_weight = measured
    try:
        for name, tensor in list(model.state_dict(keep_vars=True).items()):
            quantizer.finish([name], tensor)
    finally:
        quantized.quantize_weight = original
    quantizer.check_done()
    return model


def prompts(count: int, length: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(count)]


def all_position_logprobs(model, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """log-softmax of the logits at every position of ``prompt`` (one prefill), fp32."""
    from mlafx.graph.capture import kernels_as_custom_ops
    from mlafx.models.step import SequenceSpan, build_step_inputs

    cfg = model.config
    blocks = -(-len(prompt) // block_size)
    span = SequenceSpan(prompt, 0, len(prompt), list(range(1, blocks + 1)))
    inputs = build_step_inputs([span], block_size)
    inputs = replace(inputs, logits_indices=torch.arange(len(prompt)))
    caches = [
        torch.zeros(blocks + 1, block_size, cfg.latent_width, dtype=model.dtype)
        for _ in range(cfg.num_hidden_layers)
    ]
    with torch.no_grad(), kernels_as_custom_ops():
        logits = model(*inputs.args(caches))
    return torch.log_softmax(logits.float(), dim=-1)


def model_bytes(model) -> int:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def accuracy(args) -> list[dict]:
    cfg = bench_config(args.layers, args.experts)
    rows = []
    for weights in ("random", "structured"):
        reference = quantized_copy(cfg, weights, "bf16")
        texts = prompts(args.prompts, args.prompt_len, cfg.vocab_size)
        ref_lp = [all_position_logprobs(reference, p) for p in texts]
        rows.append({"weights": weights, "format": "bf16", "bytes": model_bytes(reference)})
        del reference
        for fmt in FORMATS:
            start = time.perf_counter()
            model = quantized_copy(cfg, weights, fmt)
            seconds = time.perf_counter() - start
            kl, agree, total = 0.0, 0, 0
            for p, ref in zip(texts, ref_lp, strict=True):
                got = all_position_logprobs(model, p)
                kl += float((ref.exp() * (ref - got)).sum())
                agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
                total += ref.shape[0]
            rows.append(
                {
                    "weights": weights,
                    "format": fmt,
                    "bytes": model_bytes(model),
                    "weight_rel_rmse": (model.weight_errors[0] / model.weight_errors[1]) ** 0.5,
                    "mean_kl": kl / total,
                    "top1": agree / total,
                    "build_s": seconds,
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr)
            del model
    return rows


def child_speed(fmt: str, layers: int, experts: int, threads: int) -> dict:
    import mlafx

    torch.set_num_threads(threads)
    cfg = bench_config(layers, experts)
    overrides = {"num_hidden_layers": layers, "n_routed_experts": cfg.n_routed_experts,
                 "n_group": cfg.n_group, "topk_group": cfg.topk_group}  # fmt: skip
    start = time.perf_counter()
    llm = mlafx.LLM(
        "deepseek-v2-lite",
        load_format="dummy",
        hf_overrides=overrides,
        quantization=None if fmt == "bf16" else fmt,
        num_kv_blocks=1024,
        progress=False,
    )
    build = time.perf_counter() - start
    params = mlafx.SamplingParams(max_tokens=64, ignore_eos=True)
    result = {"format": fmt, "build_s": build}
    for batch in (1, 8):
        batch_prompts = prompts(batch, 128, cfg.vocab_size)
        llm.generate(batch_prompts, mlafx.SamplingParams(max_tokens=4, ignore_eos=True))
        out = llm.generate(batch_prompts, params)
        tpot = sorted(o.metrics.time_per_output_token for o in out)[len(out) // 2]
        result[f"decode_b{batch}_ms"] = tpot * 1e3
    prefill = prompts(1, 1024, cfg.vocab_size)
    llm.generate(prefill, mlafx.SamplingParams(max_tokens=1))
    times = []
    for seed in range(3):
        fresh = prompts(1, 1024, cfg.vocab_size, seed=seed)  # a new prompt: no prefix hit
        start = time.perf_counter()
        llm.generate(fresh, mlafx.SamplingParams(max_tokens=1))
        times.append(time.perf_counter() - start)
    result["prefill_1024_s"] = sorted(times)[1]
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    result["peak_rss_gib"] = hwm / 2**20
    llm.close()
    return result


def speed(args) -> list[dict]:
    rows = []
    for fmt in ("bf16", "int8", "int4"):
        call = f"child_speed({fmt!r}, {args.layers}, {args.experts}, {args.threads})"
        code = (
            f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
            f"from bench.quant import child_speed; print(json.dumps({call}))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ
        )
        if out.returncode != 0:
            raise RuntimeError(f"speed child {fmt} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"loadavg {Path('/proc/loadavg').read_text().split()[:3]}", file=sys.stderr)
    report = {"accuracy": accuracy(args), "speed": speed(args) if args.speed else []}
    print(f"\n{'weights':<11}{'format':<7}{'MiB':>9}{'weight RMSE':>12}{'mean KL':>11}{'top-1':>8}")
    for row in report["accuracy"]:
        kl = f"{row['mean_kl']:.2e}" if "mean_kl" in row else "-"
        top1 = f"{100 * row['top1']:.1f}%" if "top1" in row else "-"
        rmse = f"{row['weight_rel_rmse']:.2e}" if "weight_rel_rmse" in row else "-"
        name = f"{row['weights']:<11}{row['format']:<7}{row['bytes'] / 2**20:9.0f}"
        print(f"{name}{rmse:>12}{kl:>11}{top1:>8}")
    if report["speed"]:
        print(
            f"\n{'format':<7}{'decode b1 ms':>13}{'b8 ms':>8}{'prefill 1024 s':>15}{'peak GiB':>9}"
        )
        for row in report["speed"]:
            print(
                f"{row['format']:<7}{row['decode_b1_ms']:13.1f}{row['decode_b8_ms']:8.1f}"
                f"{row['prefill_1024_s']:15.2f}{row['peak_rss_gib']:9.2f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
