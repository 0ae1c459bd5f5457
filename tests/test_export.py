"""Artifacts (mlafx/export): written once per format from the tiny model (fp32, block size 4)
and served in a fresh process through the engine (scheduler, paged cache, prefix caching),
against the in-process AOTInductor-compiled engine; refusals of tampered, incomplete and
mismatched artifacts.

The aoti artifact is the compiled engine's own package (cached under .cache/), so its tokens
and log-probabilities must be identical. pt2 runs the same lowered graph eagerly and ONNX
runs it in onnxruntime with the ops translated: greedy tokens must match and log-
probabilities agree within 1e-4 (fp32)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlafx
from mlafx.cli import main
from mlafx.compile.compiled_step import lower_step
from mlafx.export.artifact import load_artifact
from mlafx.export.functional_step import check, make_functional
from mlafx.export.manifest import MANIFEST_FILE, ArtifactError, config_from_dict
from mlafx.export.onnx_export import plain_linears
from mlafx.export.weights import WEIGHTS_FILE
from mlafx.graph.capture import sample_step
from mlafx.passes.pipeline import op_histogram
from mlafx.passes.verify import random_caches
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 4
PROMPTS = [list(range(10, 23)), list(range(10, 23)) + [40, 41, 42], [3], [7, 8, 9, 10, 11]]
MAX_TOKENS = 6

# Runs in a fresh process: serves an artifact twice (the second pass hits the prefix cache)
# with the model code and every compiler entry point disabled, and prints the results.
CHILD = """
import json, sys, torch
import mlafx.compile.compiled_step as compiled_step
import mlafx.models.deepseek as deepseek

def refuse(*args, **kwargs):
    raise AssertionError("serving an artifact must not build the model or compile")

deepseek.MLAForCausalLM.__init__ = refuse
torch._inductor.aoti_compile_and_package = refuse
compiled_step.lower_step = refuse
import mlafx

directory, engine, prompts, max_tokens = sys.argv[1], sys.argv[2] or None, *json.loads(sys.argv[3])
llm = mlafx.LLM.from_artifact(directory, engine=engine, num_kv_blocks=128)
params = mlafx.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
runs = [llm.generate(prompts, params) for _ in range(2)]
print(json.dumps([
    [
        {
            "tokens": o.outputs[0].token_ids,
            "logprobs": [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            "cached": o.num_cached_tokens,
        }
        for o in outs
    ]
    for outs in runs
]))
"""


def serve_in_fresh_process(directory: Path, engine: str | None = None) -> list[list[dict]]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(directory),
            engine or "",
            json.dumps([PROMPTS, MAX_TOKENS]),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def export_tiny(directory: Path, format: str, **kwargs) -> mlafx.export.manifest.Manifest:
    options = dict(
        load_format="dummy",
        hf_overrides=TINY_OVERRIDES,
        dtype="float32",
        block_size=BLOCK_SIZE,
        progress=False,
    )
    options.update(kwargs)
    return mlafx.export("deepseek-v2-lite", directory, format, **options)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("artifacts")
    for format in ("aoti", "pt2", "onnx"):
        export_tiny(root / format, format)
    return {format: root / format for format in ("aoti", "pt2", "onnx")}


@pytest.fixture(scope="module")
def compiled_reference() -> list[dict]:
    """The in-process compiled engine's greedy tokens and log-probabilities."""
    llm = tiny_llm(compile=True)
    params = mlafx.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return [
        {
            "tokens": o.outputs[0].token_ids,
            "logprobs": [
                lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ],
        }
        for o in llm.generate(PROMPTS, params)
    ]


def assert_serves_like(runs: list[list[dict]], reference: list[dict], logprob_tol: float) -> None:
    first, again = runs
    for i, (got, want) in enumerate(zip(first, reference, strict=True)):
        assert got["tokens"] == want["tokens"], f"prompt {i}: {got['tokens']} != {want['tokens']}"
        diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
        assert diff <= logprob_tol, f"prompt {i}: log-probabilities differ by {diff:.3g}"
    # the second pass reuses the first pass's full blocks and must not change a token
    assert [o["tokens"] for o in again] == [o["tokens"] for o in first]
    assert sum(o["cached"] for o in again) >= len(PROMPTS[0]) // BLOCK_SIZE * BLOCK_SIZE


def test_aoti_artifact_in_a_fresh_process_is_the_compiled_engine(artifacts, compiled_reference):
    assert_serves_like(serve_in_fresh_process(artifacts["aoti"]), compiled_reference, 0.0)


def test_pt2_artifact_in_a_fresh_process_matches_the_compiled_engine(artifacts, compiled_reference):
    assert_serves_like(serve_in_fresh_process(artifacts["pt2"]), compiled_reference, 1e-4)


def test_onnx_artifact_on_onnxruntime_matches_the_compiled_engine(artifacts, compiled_reference):
    runs = serve_in_fresh_process(artifacts["onnx"], "onnxruntime")
    assert_serves_like(runs, compiled_reference, 1e-4)


@pytest.fixture(scope="module")
def tiny_lowered():
    """The tiny model and its lowered step (capture -> passes -> re-export)."""
    model = tiny_llm().model
    return model, lower_step(model, BLOCK_SIZE)


def test_functional_step_turns_cache_writes_into_outputs(tiny_lowered):
    model, lowered = tiny_lowered
    layers = model.config.num_hidden_layers
    before = op_histogram(lowered.lowering.graph)
    functional = make_functional(lowered.lowering.graph)
    rewritten = plain_linears(functional)
    after = op_histogram(functional)
    write, with_rows = "mlafx.write_latent_cache.default", "mlafx_export.{}_with_rows.default"
    reads = ["mlafx.mla_attention_paged.default", "mlafx.gather_latent.default"]
    reads += [with_rows.format("mla_attention_paged"), with_rows.format("gather_latent")]
    assert before[write] == layers and after[write] == 0
    assert sum(after[r] for r in reads) == sum(before[r] for r in reads)
    assert after[with_rows.format("mla_attention_paged")] >= layers  # each layer reads its rows
    assert rewritten == before["mlafx.linear_packed.default"] > 0
    assert after["mlafx.linear_packed.default"] == 0
    assert after["aten.linear.default"] == before["aten.linear.default"] + rewritten
    assert not [name for name, _ in functional.named_buffers() if name.endswith("_packed")]
    sample, caches = sample_step(model, BLOCK_SIZE)
    report = check(lowered.lowering.graph, functional, sample, caches)
    assert report.max_abs_output_diff <= 1e-5 and report.max_abs_cache_diff <= 1e-6
    with torch.no_grad():
        logits, rows = functional(sample.input_ids, sample.positions, caches, sample.meta,
                                  sample.logits_indices)  # fmt: skip
    assert len(rows) == layers
    assert rows[0].shape == (sample.input_ids.shape[0], model.config.latent_width)
    assert not any(c.any() for c in caches), "the functional step wrote into its inputs"


def test_onnx_step_logits_agree_with_torch(artifacts, tiny_lowered):
    """One step of every row kind (the passes' sample step) from random caches: logits
    within 1e-4 of the torch-lowered step, and the host-written cache rows too."""
    import onnx

    onnx.checker.check_model(str(artifacts["onnx"] / "step.onnx"), full_check=True)
    model, lowered = tiny_lowered
    lowered = lowered.lowering.graph
    sample, caches = sample_step(model, BLOCK_SIZE)
    step = load_artifact(artifacts["onnx"], engine="onnxruntime").step
    want_caches = random_caches(caches)
    got_caches = [c.clone() for c in want_caches]
    args = (sample.input_ids, sample.positions)
    rest = (sample.meta, sample.logits_indices)
    with torch.inference_mode():
        want = lowered(*args, want_caches, *rest)
        got = step(*args, got_caches, *rest)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_cli_export_and_run_artifact(tmp_path, capsys):
    directory = tmp_path / "pt2"
    overrides = json.dumps(TINY_OVERRIDES)
    model_flags = ["--model", "deepseek-v2-lite", "--load-format", "dummy"]
    model_flags += ["--hf-overrides", overrides, "--dtype", "float32", "--block-size", "4"]
    assert main(["export", "--format", "pt2", "--output", str(directory), *model_flags]) == 0
    assert "step.pt2" in capsys.readouterr().out
    code = main(["run", "--artifact", str(directory), "--prompt-token-ids", "3,4,5", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "float32" and len(out["outputs"][0]["token_ids"]) == 16


def test_manifest_describes_the_artifact(artifacts):
    from mlafx.export.manifest import Manifest, sha256_file

    model = tiny_llm().model
    for format, directory in artifacts.items():
        manifest = Manifest.read(directory)
        assert manifest.format == format and manifest.block_size == BLOCK_SIZE
        assert manifest.mlafx_version == mlafx.__version__
        assert manifest.torch_version == torch.__version__
        assert manifest.dtype == "float32"
        assert config_from_dict(manifest.model_config) == model.config
        names = {p.name for p in directory.iterdir()} - {MANIFEST_FILE}
        assert set(manifest.files) == names and WEIGHTS_FILE in names
        for name, entry in manifest.files.items():
            assert entry["sha256"] == sha256_file(directory / name)
    aoti = Manifest.read(artifacts["aoti"])
    assert "mlafx::mla_attention_paged" in aoti.custom_ops
    assert "avx512f" in aoti.cpu["required_flags"] or "avx2" in aoti.cpu["required_flags"]
    assert Manifest.read(artifacts["pt2"]).cpu["required_flags"] == []
    assert Manifest.read(artifacts["onnx"]).custom_ops == {}  # translated to standard ops


# ---- refusals ------------------------------------------------------------------------------


@pytest.fixture
def pt2_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["pt2"], tmp_path / "copy"))


def edit_manifest(directory: Path, edit) -> None:
    raw = json.loads((directory / MANIFEST_FILE).read_text())
    edit(raw)
    (directory / MANIFEST_FILE).write_text(json.dumps(raw))


def refuses(directory: Path, match: str, monkeypatch) -> None:
    """Loading is refused with ``match``, and nothing of the artifact was read."""

    def must_not_load(*args, **kwargs):
        raise AssertionError("a refused artifact was loaded")

    monkeypatch.setattr(torch.export, "load", must_not_load)
    monkeypatch.setattr("mlafx.export.artifact.load_weights", must_not_load)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(directory)


def test_tampered_file_is_refused_before_loading(pt2_copy, monkeypatch, capsys):
    weights = pt2_copy / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    refuses(pt2_copy, "weights.safetensors does not match its sha256", monkeypatch)
    assert main(["run", "--artifact", str(pt2_copy)]) == 2
    assert "does not match its sha256" in capsys.readouterr().err


def test_missing_file_is_refused(pt2_copy, monkeypatch):
    (pt2_copy / "step.pt2").unlink()
    refuses(pt2_copy, "incomplete: step.pt2 is missing", monkeypatch)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("mlafx_version", "0.0.1", "written by mlafx 0.0.1"),
        ("torch_version", "2.0.0", "written with torch 2.0.0"),
        ("artifact_version", 99, "layout version 99"),
        ("cache_layout_version", 0, "cache layout 0"),
    ],
)
def test_mismatched_versions_are_refused(pt2_copy, monkeypatch, field, value, match):
    edit_manifest(pt2_copy, lambda raw: raw.__setitem__(field, value))
    refuses(pt2_copy, match, monkeypatch)


def test_changed_op_schema_is_refused(pt2_copy, monkeypatch):
    def edit(raw):
        raw["custom_ops"]["mlafx::mla_attention_paged"] += " "

    edit_manifest(pt2_copy, edit)
    refuses(pt2_copy, "mlafx::mla_attention_paged with schema", monkeypatch)


def test_cpu_without_the_compiled_isa_is_refused(pt2_copy, monkeypatch):
    edit_manifest(pt2_copy, lambda raw: raw["cpu"].update(required_flags=["avx512_imaginary"]))
    refuses(pt2_copy, "this CPU lacks avx512_imaginary", monkeypatch)


def test_not_an_artifact_and_wrong_engine_are_refused(artifacts, tmp_path, monkeypatch):
    refuses(tmp_path, "has no manifest.json", monkeypatch)
    with pytest.raises(ArtifactError, match="engine 'onnxruntime' cannot serve a pt2 artifact"):
        load_artifact(artifacts["pt2"], engine="onnxruntime")


def test_export_refusals(artifacts, tmp_path):
    with pytest.raises(ValueError, match="ONNX export needs --dtype float32"):
        export_tiny(tmp_path / "bf16", "onnx", dtype="bfloat16")
    with pytest.raises(ValueError, match="is not an empty directory"):
        export_tiny(artifacts["pt2"], "pt2")
    with pytest.raises(ValueError, match="unknown artifact format"):
        export_tiny(tmp_path / "x", "tflite")
    assert not (tmp_path / "bf16").exists() and not list(tmp_path.glob(".*partial"))


# ---- pieces --------------------------------------------------------------------------------


def test_weights_file_stores_shared_tensors_once(tmp_path):
    from mlafx.export.weights import load_weights, save_weights
    from mlafx.models.safetensors_file import tensor_locations

    embed = torch.randn(8, 4)
    fused = torch.randn(6, 4)
    constants = {"embed": embed, "lm_head": embed, "gate": fused[:3], "up": fused[3:]}
    aliases = save_weights(constants, tmp_path / WEIGHTS_FILE)
    assert aliases == {"lm_head": "embed"}
    assert set(tensor_locations(tmp_path / WEIGHTS_FILE)) == {"embed", "gate", "up"}
    loaded = load_weights(tmp_path / WEIGHTS_FILE, aliases)
    assert loaded["lm_head"] is loaded["embed"]
    for name, tensor in constants.items():
        assert torch.equal(loaded[name], tensor)


def test_pt2_archive_holds_no_weights_and_no_pickles(artifacts):
    import zipfile

    with zipfile.ZipFile(artifacts["pt2"] / "step.pt2") as archive:
        for name in archive.namelist():
            if name.endswith("_config.json"):
                config = json.loads(archive.read(name))["config"]
                assert not config, f"{name} lists stored tensors: {list(config)[:5]}"
            assert not name.endswith(".pt") or archive.getinfo(name).file_size == 0, name


def test_export_package_is_callable_and_keeps_its_submodules():
    import mlafx.compile.compiled_step as compiled_step

    assert callable(mlafx.export) and compiled_step.__name__ == "mlafx.compile.compiled_step"


def test_a_checkpoints_tokenizer_and_chat_template_ship_with_its_artifact(tmp_path):
    from mlafx.runtime.chat_template import load_chat_template
    from mlafx.runtime.tokenizer import load_tokenizer
    from tests.tiny_models import write_tiny_chat_checkpoint

    checkpoint = write_tiny_chat_checkpoint(tmp_path / "checkpoint")
    mlafx.export(checkpoint, tmp_path / "artifact", "pt2", dtype="float32", progress=False)
    texts = ["w1 w2 w3", "w4 <eos> w5"]
    want, got = load_tokenizer(checkpoint), load_tokenizer(tmp_path / "artifact")
    assert [got.encode(t).ids for t in texts] == [want.encode(t).ids for t in texts]
    assert load_chat_template(tmp_path / "artifact") == load_chat_template(checkpoint)
