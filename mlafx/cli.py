"""Command line: ``mlafx run``, ``serve``, ``export``, ``inspect`` and ``bench``.

``mlafx run`` with no arguments serves the embedded default: the ``deepseek-v2-lite`` preset
shrunk to 2 layers and 4 experts, with dummy weights, in bf16, on a batch of token-id
prompts including a ~300-token one, which it then sends again (a prefix-cache hit) and into
a second engine sharing a disk KV store (an external hit). Flags follow vLLM's names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES, ServedConfig
from mlafx.parallel import TensorParallelError
from mlafx.runtime import LLM, RequestOutput, SamplingParams
from mlafx.runtime.engine import check_model, check_prompt_token_ids
from mlafx.runtime.kv_connector.base import KVConnectorError
from mlafx.runtime.sampling_params import RequestMetrics


def demo_prompts() -> list[list[int]]:
    """Deterministic token-id prompts of 8, 40 and 300 tokens (valid for any vocab >= 1000)."""
    return [[(17 * i + 3) % 1000 for i in range(length)] for length in (8, 40, 300)]


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids, got {text!r}"
        ) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--hf-overrides is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--hf-overrides must be a JSON object")
    return value


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose and shape the model, shared by the subcommands."""
    parser.add_argument(
        "--model",
        help="preset name, local model directory or .gguf file "
        "(default: the embedded shrunk DeepSeek-V2-Lite with dummy weights)",
    )
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        help="'auto' reads safetensors, 'dummy' random weights "
        "(default: dummy for the embedded model, else auto)",
    )
    parser.add_argument(
        "--hf-overrides",
        type=_json_object,
        default=None,
        help="JSON object applied over config.json, e.g. '{\"num_hidden_layers\": 2}'",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        default=None,
        help="quantize every linear and routed expert as it loads: int8 (8.5 bits per weight) "
        "or int4 (4.5); groups of 32 with fp16 scales, llama.cpp's Q8_0/Q4_0 blocks",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the captured, MLA-lowered, AOTInductor-compiled step (default; compiled "
        "once per layer kind, cached under $MLAFX_CACHE_DIR or ~/.cache/mlafx/compiled); "
        "--no-compile runs the plain reference model",
    )


def add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """Batching, caching and KV-store flags (``mlafx run``)."""
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="new tokens per step"
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split prompts longer than the step's token budget across steps (default on)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse computed full KV blocks across requests (default on, any block size)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs are bitwise the same whatever else is in the "
        "batch, however its prompt is chunked and wherever its prefix came from (slower; "
        "compiled step, not with --quantization or --artifact)",
    )
    parser.add_argument(
        "--kv-connector",
        default=None,
        metavar="SPEC",
        help="share computed prefixes through a KV store: disk:PATH or redis://HOST:PORT",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over N worker processes (torch.distributed, gloo), each on "
        "1/N of the cores; not with --kv-connector or --artifact",
    )
    parser.add_argument(
        "--tensor-parallel-local-ranks",
        type=int,
        default=None,
        metavar="L",
        help="start ranks 0..L-1 here; the others run on other machines "
        "(python -m mlafx.parallel.remote --rank R; rendezvous: MASTER_ADDR/MASTER_PORT)",
    )


def serving_options(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_connector": args.kv_connector,
        "batch_invariant": args.batch_invariant,
    }


def build_llm(args: argparse.Namespace, **serving: Any) -> LLM:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if getattr(args, "artifact", None) is not None:
        if getattr(args, "tensor_parallel_size", 1) != 1:
            raise ValueError("--tensor-parallel-size cannot be combined with --artifact")
        return llm_from_artifact(args, **serving)
    model, options = llm_arguments(args)
    return LLM(model, **options, **serving)


def llm_arguments(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The model, and the keyword arguments besides the ``serving_options`` flags, that
    ``build_llm`` builds ``LLM`` from (the embedded default when no --model is given)."""
    model, overrides = args.model, args.hf_overrides
    load_format = args.load_format
    if model is None:
        model = EMBEDDED_DEFAULT_MODEL
        overrides = {**EMBEDDED_DEFAULT_OVERRIDES, **(overrides or {})}
        load_format = load_format or "dummy"
    return model, {
        "load_format": load_format or "auto",
        "hf_overrides": overrides,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "num_kv_blocks": args.num_kv_blocks,
        "seed": args.seed,
        "progress": sys.stderr.isatty(),
        "compile": args.compile,
        "tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
        "tensor_parallel_local_ranks": getattr(args, "tensor_parallel_local_ranks", None),
    }


def check_prompts_before_building(args: argparse.Namespace) -> None:
    """``--prompt-token-ids`` against the model's config before the build and compile (minutes
    for a real model): an id outside the vocabulary, or a bad option, fails at once."""
    if args.prompt_token_ids is None or getattr(args, "artifact", None) is not None:
        return
    model, options = llm_arguments(args)
    config = check_model(model, **options)
    for index, prompt in enumerate(args.prompt_token_ids):
        check_prompt_token_ids(prompt, config, index)


def add_artifact_flags(parser: argparse.ArgumentParser) -> None:
    """``--artifact DIR`` (serve an exported artifact) and ``--engine``."""
    parser.add_argument(
        "--artifact",
        type=Path,
        default=None,
        help="serve an artifact written by `mlafx export` (its model, dtype and block size; "
        "no model code, no compilation)",
    )
    parser.add_argument(
        "--engine",
        choices=["torch", "onnxruntime"],
        default=None,
        help="runner for --artifact (default: the format's own; onnxruntime for ONNX)",
    )


def llm_from_artifact(args: argparse.Namespace, **serving: Any) -> LLM:
    """The engine for ``--artifact``; model-choosing flags are refused (the artifact fixes
    the model), and args' dtype and block size are set to the artifact's."""
    fixed = ("model", "load_format", "hf_overrides", "quantization")
    given = [f for f in fixed if getattr(args, f, None) is not None]
    if serving.pop("batch_invariant", False):
        raise ValueError("--batch-invariant cannot be combined with --artifact yet")
    if given:
        flags = ", ".join("--" + f.replace("_", "-") for f in given)
        raise ValueError(f"{flags} cannot be combined with --artifact (it fixes the model)")
    llm = LLM.from_artifact(
        args.artifact,
        engine=args.engine,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        seed=args.seed,
        **serving,
    )
    assert llm.artifact is not None
    args.dtype, args.block_size = llm.artifact.dtype, llm.block_size
    return llm


def cmd_export(args: argparse.Namespace) -> int:
    """Write an artifact directory (see mlafx/export/artifact.py) and list its files."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, overrides, load_format = args.model, args.hf_overrides, args.load_format
    if model is None:
        model = EMBEDDED_DEFAULT_MODEL
        overrides = {**EMBEDDED_DEFAULT_OVERRIDES, **(overrides or {})}
        load_format = load_format or "dummy"
    from mlafx.export.artifact import export

    start = time.perf_counter()
    manifest = export(
        model,
        args.output,
        args.format,
        load_format=load_format or "auto",
        hf_overrides=overrides,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        seed=args.seed,
        progress=sys.stderr.isatty(),
    )
    seconds = time.perf_counter() - start
    if args.json:
        summary = {"output": str(args.output), "seconds": seconds, **dataclasses.asdict(manifest)}
        print(json.dumps(summary, indent=2))
        return 0
    total = sum(entry["bytes"] for entry in manifest.files.values())
    print(f"wrote {manifest.format} artifact {args.output} in {seconds:.1f} s:")
    for name, entry in manifest.files.items():
        print(f"  {name:<22} {entry['bytes'] / 2**20:9.2f} MiB  sha256 {entry['sha256'][:16]}")
    print(f"  {'total':<22} {total / 2**20:9.2f} MiB")
    print(f"serve it: mlafx run --artifact {args.output}")
    return 0


def summarize(outputs: list[RequestOutput], wall_seconds: float) -> dict[str, Any]:
    """Per-request TTFT, and decode throughput over the whole batch."""
    metrics = [finished_metrics(o) for o in outputs]
    ttft = [_known(m.time_to_first_token) for m in metrics]
    first = min(_known(m.first_token_time) for m in metrics)
    last = max(_known(m.finished_time) for m in metrics)
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    return {
        "ttft_s": ttft,
        "ttft_median_s": statistics.median(ttft),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / (last - first) if last > first else float("nan"),
        "wall_s": wall_seconds,
    }


def finished_metrics(output: RequestOutput) -> RequestMetrics:
    """The metrics of a finished request (``LLM.generate`` sets them on every output)."""
    if output.metrics is None:
        raise RuntimeError(f"request {output.request_id} has no metrics")
    return output.metrics


def _known(value: float | None) -> float:
    """A milestone time a finished request has (it produced at least one token)."""
    if value is None:
        raise RuntimeError("a finished request lacks a milestone time")
    return value


def prefix_reuse_demo(
    args: argparse.Namespace,
    serving: dict[str, Any],
    llm: LLM,
    cold: RequestOutput,
    params: SamplingParams,
) -> dict[str, Any]:
    """The demo's second act: ``cold``'s prompt again on the same engine (a prefix-cache
    hit), then on a second engine sharing the KV store (an external hit)."""
    prompt = cold.prompt_token_ids
    (again,) = llm.generate([prompt], params)
    second = build_llm(args, **serving)
    try:
        (external,) = second.generate([prompt], params)
        external_tokens = second.get_metrics()["external_hit_tokens"]
    finally:
        second.close()
    runs = (cold, again, external)
    return {
        "prompt_len": len(prompt),
        "kv_connector": serving["kv_connector"],
        "cold_ttft_s": finished_metrics(cold).time_to_first_token,
        "prefix_hit_cached_tokens": again.num_cached_tokens,
        "prefix_hit_ttft_s": finished_metrics(again).time_to_first_token,
        "external_hit_tokens": external_tokens,
        "external_hit_ttft_s": finished_metrics(external).time_to_first_token,
        "same_tokens": all(r.outputs[0].token_ids == cold.outputs[0].token_ids for r in runs),
    }


def cmd_run(args: argparse.Namespace) -> int:
    demo = args.prompt_token_ids is None
    serving = serving_options(args)
    with tempfile.TemporaryDirectory(prefix="mlafx-demo-store-") as store:
        # the demo's second engine shares a KV store (not with tensor parallelism)
        store_demo = demo and args.tensor_parallel_size == 1
        if store_demo and serving["kv_connector"] is None:
            serving["kv_connector"] = f"disk:{store}"
        check_prompts_before_building(args)
        start = time.perf_counter()
        llm = build_llm(args, **serving)
        load_seconds = time.perf_counter() - start
        prompts = args.prompt_token_ids or demo_prompts()
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        try:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            stats = summarize(outputs, time.perf_counter() - start)
            metrics = llm.get_metrics()
            longest = max(outputs, key=lambda o: len(o.prompt_token_ids))
            reuse = prefix_reuse_demo(args, serving, llm, longest, params) if store_demo else None
        finally:
            llm.close()
    report = _RunReport(args, llm.config, load_seconds, outputs, stats, metrics, reuse)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        report.print_text()
    return 0


@dataclasses.dataclass
class _RunReport:
    """What ``mlafx run`` prints: as JSON (``--json``) or as text."""

    args: argparse.Namespace
    config: ServedConfig
    load_seconds: float
    outputs: list[RequestOutput]
    stats: dict[str, Any]
    metrics: dict[str, Any]
    reuse: dict[str, Any] | None

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.config.model_type,
            "num_hidden_layers": self.config.num_hidden_layers,
            "dtype": self.args.dtype,
            "load_s": self.load_seconds,
            "outputs": [
                {
                    "prompt_len": len(o.prompt_token_ids),
                    "token_ids": o.outputs[0].token_ids,
                    "finish_reason": o.outputs[0].finish_reason,
                    "num_cached_tokens": o.num_cached_tokens,
                    "ttft_s": finished_metrics(o).time_to_first_token,
                    "tpot_s": finished_metrics(o).time_per_output_token,
                }
                for o in self.outputs
            ],
            **self.stats,
            "metrics": self.metrics,
            **({"prefix_reuse": self.reuse} if self.reuse else {}),
        }

    def print_text(self) -> None:
        cfg, args, stats, metrics = self.config, self.args, self.stats, self.metrics
        print(
            f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} "
            f"experts, {args.dtype}, block size {args.block_size} (loaded in "
            f"{self.load_seconds:.1f} s)"
        )
        for i, out in enumerate(self.outputs):
            cached = f", {out.num_cached_tokens} cached" if out.num_cached_tokens else ""
            print(
                f"prompt {i} ({len(out.prompt_token_ids)} tokens{cached}) -> "
                f"{out.outputs[0].token_ids} [{out.outputs[0].finish_reason}]"
            )
        print(
            f"time to first token: median {stats['ttft_median_s'] * 1e3:.1f} ms "
            f"(per prompt: {', '.join(f'{t * 1e3:.1f}' for t in stats['ttft_s'])} ms)"
        )
        print(
            f"decode: {stats['decode_tokens']} tokens, {stats['decode_tokens_per_s']:.1f} tokens/s"
        )
        tpot = [finished_metrics(o).time_per_output_token for o in self.outputs]
        known = [t for t in tpot if t is not None]
        if len(known) == len(tpot):
            print(f"time per output token: median {statistics.median(known) * 1e3:.1f} ms")
        print(
            f"engine: prefix cache hit rate {metrics['prefix_cache_hit_rate']:.1%}, external "
            f"hits {metrics['external_hit_tokens']} tokens "
            f"({metrics['external_cache_hit_rate']:.1%}), {metrics['num_preemptions']} "
            f"preemptions, prompt {metrics['prompt_tokens_per_s']:.1f} tokens/s, generation "
            f"{metrics['generation_tokens_per_s']:.1f} tokens/s"
        )
        reuse = self.reuse
        if reuse:
            print(
                f"prefix reuse ({reuse['prompt_len']}-token prompt): cold TTFT "
                f"{reuse['cold_ttft_s'] * 1e3:.1f} ms; again: {reuse['prefix_hit_cached_tokens']} "
                f"tokens from the prefix cache, TTFT {reuse['prefix_hit_ttft_s'] * 1e3:.1f} ms; "
                f"second engine: {reuse['external_hit_tokens']} tokens from the KV store, TTFT "
                f"{reuse['external_hit_ttft_s'] * 1e3:.1f} ms; same tokens: "
                f"{'yes' if reuse['same_tokens'] else 'NO'}"
            )


def cmd_inspect(args: argparse.Namespace) -> int:
    from mlafx.graph.capture import capture_step, num_sample_blocks, sample_step
    from mlafx.passes.pipeline import lower_step_graph
    from mlafx.passes.report import format_text, lowering_report

    args.num_kv_blocks = args.num_kv_blocks or num_sample_blocks(args.block_size)
    args.compile = False  # the reference model, which inspect captures and lowers itself
    llm = build_llm(args)
    from mlafx.models.deepseek import MLAForCausalLM
    from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM

    with_graphs = args.graphs or args.stage is not None or args.html is not None
    if isinstance(llm.model, DeepseekV4ForCausalLM):
        report, text, graphs = _inspect_v4(llm.model, args.block_size, with_graphs, args.stage)
    elif isinstance(llm.model, MLAForCausalLM):  # compile=False: the reference model
        start = time.perf_counter()
        captured = capture_step(llm.model, args.block_size)
        capture_seconds = time.perf_counter() - start
        sample, caches = sample_step(llm.model, args.block_size)
        result = lower_step_graph(captured.module(), sample, caches, capture_seconds)
        report = lowering_report(result, with_graphs=with_graphs)
        text = format_text(report, args.stage)
        graphs = {stage.name: stage.graph for stage in result.stages}
    else:
        raise ValueError(f"mlafx inspect: {llm.config.model_type} has no lowering")
    if args.html is not None:
        from mlafx.passes.report_html import graph_svg, render_html

        svgs = {name: graph_svg(graph) for name, graph in graphs.items()}
        title = f"mlafx inspect: {llm.config.model_type}, {llm.config.num_hidden_layers} layers"
        args.html.write_text(render_html(report, svgs, title))
        print(f"wrote {args.html}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(text)
    return 0


def _inspect_v4(
    model: Any, block_size: int, with_graphs: bool, stage: str | None
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """DeepSeek-V4's lowering report, one capture per layer kind (as it compiles): the report,
    its text, each stage's graph by the report's stage name."""
    from mlafx.compile.v4_compiled_step import v4_layer_kinds
    from mlafx.passes.report import format_v4_text, v4_lowering_report
    from mlafx.passes.v4_pipeline import lower_v4_layer

    kinds = [
        (kind.name, kind.layers, lower_v4_layer(model, kind.layers[0], block_size))
        for kind in v4_layer_kinds(model)
    ]
    report = v4_lowering_report(kinds, with_graphs=with_graphs)
    graphs = {f"{name}: {st.name}": st.graph for name, _, lo in kinds for st in lo.stages}
    return report, format_v4_text(report, stage), graphs


def served_model_name(args: argparse.Namespace) -> str:
    """The name clients send as ``model``: ``--served-model-name``, else the artifact
    directory, the ``--model`` argument, or the embedded default's preset name."""
    if args.served_model_name:
        return args.served_model_name
    if args.artifact is not None:
        return str(args.artifact)
    return args.model or EMBEDDED_DEFAULT_MODEL


def cmd_serve(args: argparse.Namespace) -> int:
    """An OpenAI-compatible HTTP server (see mlafx/serve/) until Ctrl-C."""
    from mlafx.serve import bind, serve

    sock = bind(args.host, args.port)  # a busy port fails before the model loads
    try:
        llm = build_llm(args, **serving_options(args))
    except BaseException:
        sock.close()
        raise
    serve(llm, sock, model_name=served_model_name(args), log_level=args.log_level)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with the model in the terminal (see mlafx/chat_session.py)."""
    from mlafx.chat_session import chat_loop

    llm = build_llm(args, **serving_options(args))
    try:
        if llm.tokenizer is None or llm.chat_template is None:
            raise ValueError(
                "this model has no tokenizer or chat template (tokenizer_config.json's "
                "chat_template, chat_template.jinja or a GGUF's tokenizer.chat_template)"
            )
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        chat_loop(llm, params, input, sys.stdout, system=args.system)
    finally:
        llm.close()
    return 0


BENCHMARKS = {
    "kernels": "kernels.py",
    "compiled-step": "compiled_step.py",
    "export": "export.py",
    "serve-load": "serve_load.py",
    "e2e": "e2e/main.py",
    "tensor-parallel": "tensor_parallel.py",
    "real-size": "real_size.py",
    "host-step-inputs": "host_step_inputs.py",
    "load-weights": "load_weights.py",
    "quant": "quant.py",
    "busy-machine": "busy_machine.py",
    "attention-path": "attention_path.py",
    "invariant-cost": "invariant_cost.py",
}


def cmd_bench(args: argparse.Namespace) -> int:
    """Run a benchmark script of the source checkout's bench/ with the remaining flags."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "bench" / BENCHMARKS[args.which]
    if not script.is_file():
        print(
            f"mlafx bench: {script} not found (benchmarks run from a source checkout)",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(script), *args.bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlafx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="generate for a batch of prompts and print the tokens and timings"
    )
    add_model_flags(run)
    add_serving_flags(run)
    run.add_argument(
        "--prompt-token-ids",
        type=_token_ids,
        action="append",
        help="a prompt as comma-separated token ids (repeatable; default: demo prompts)",
    )
    run.add_argument("--max-tokens", type=int, default=16)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_artifact_flags(run)
    run.set_defaults(func=cmd_run)
    export = sub.add_parser(
        "export", help="write an ahead-of-time artifact (aoti, pt2 or onnx) of the model"
    )
    add_model_flags(export)
    export.add_argument("--format", choices=["aoti", "pt2", "onnx"], default="aoti")
    export.add_argument("--output", type=Path, required=True, help="a new directory")
    export.add_argument("--json", action="store_true", help="print the manifest as JSON")
    export.set_defaults(func=cmd_export)
    inspect = sub.add_parser(
        "inspect", help="capture the step graph, run the MLA passes, report every stage"
    )
    add_model_flags(inspect)
    inspect.add_argument(
        "--stage",
        default=None,
        help="print only this stage (captured, find_mla_attention, "
        "lower_attention, verify), with its graph",
    )
    inspect.add_argument("--graphs", action="store_true", help="include every stage's graph")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.add_argument(
        "--html",
        type=Path,
        default=None,
        help="also write a self-contained HTML report (needs graphviz)",
    )
    inspect.set_defaults(func=cmd_inspect)
    serve = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (/v1/completions, /metrics, ...)"
    )
    add_model_flags(serve)
    add_serving_flags(serve)
    add_artifact_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one)")
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: --model, --artifact or the preset name)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level ('info' logs every request)",
    )
    serve.set_defaults(func=cmd_serve)
    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    add_model_flags(chat)
    add_serving_flags(chat)
    add_artifact_flags(chat)
    chat.add_argument("--max-tokens", type=int, default=512, help="per reply")
    chat.add_argument("--temperature", type=float, default=0.6)
    chat.add_argument("--system", default=None, help="a system prompt opening the conversation")
    chat.set_defaults(func=cmd_chat)
    bench = sub.add_parser("bench", help="run a benchmark (flags after the name go to it)")
    bench.add_argument("which", choices=sorted(BENCHMARKS))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, KVConnectorError, TensorParallelError) as e:  # a clear message
        print(f"mlafx {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
