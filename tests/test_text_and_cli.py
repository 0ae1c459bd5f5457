"""Text prompts through a model directory's tokenizer.json, and the `mlafx run` CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mlafx
from mlafx.cli import demo_prompts, main
from tests.tiny_models import WORDS, write_tiny_checkpoint_with_tokenizer


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_with_tokenizer")
    return write_tiny_checkpoint_with_tokenizer(directory)


def test_text_prompts_are_tokenized_and_outputs_decoded(checkpoint_with_tokenizer):
    llm = mlafx.LLM(
        str(checkpoint_with_tokenizer), dtype="float32", num_kv_blocks=32, progress=False
    )
    params = mlafx.SamplingParams(max_tokens=5, ignore_eos=True)
    (by_text,) = llm.generate("w3 w4 w5", params)
    (by_ids,) = llm.generate([[5, 6, 7]], params)
    assert by_text.prompt_token_ids == [5, 6, 7] and by_text.prompt == "w3 w4 w5"
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == " ".join(WORDS[t] for t in by_ids.outputs[0].token_ids)


def test_cli_run_json_with_a_checkpoint(checkpoint_with_tokenizer, capsys):
    code = main(
        [
            "run",
            "--model",
            str(checkpoint_with_tokenizer),
            "--dtype",
            "float32",
            "--prompt-token-ids",
            "5,6,7",
            "--prompt-token-ids",
            "9,10",
            "--max-tokens",
            "4",
            "--num-kv-blocks",
            "16",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [o["prompt_len"] for o in report["outputs"]] == [3, 2]
    assert all(len(o["token_ids"]) <= 4 for o in report["outputs"])
    assert report["decode_tokens_per_s"] > 0 and len(report["ttft_s"]) == 2


def test_cli_bad_input_is_a_clear_error(checkpoint_with_tokenizer, capsys, monkeypatch):
    """A prompt id outside the vocabulary is refused before the model is built (a build and
    compile take minutes for a real model)."""

    def build(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was built before the prompts were checked")

    monkeypatch.setattr("mlafx.cli.LLM", build)
    code = main(
        [
            "run",
            "--model",
            str(checkpoint_with_tokenizer),
            "--prompt-token-ids",
            "5,999",
            "--num-kv-blocks",
            "16",
        ]
    )
    assert code == 2
    assert "outside the vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--hf-overrides", "{not json"])


def test_demo_prompts_include_a_300_token_prompt():
    assert sorted(len(p) for p in demo_prompts()) == [8, 40, 300]


def test_mlafx_run_with_no_arguments_serves_the_embedded_default():
    """The newcomer's first command (`make run`): a real subprocess, bf16, dummy weights."""
    result = subprocess.run(
        [sys.executable, "-m", "mlafx.cli", "run", "--max-tokens", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == "deepseek_v2" and report["num_hidden_layers"] == 2
    assert report["dtype"] == "bfloat16"
    assert [o["prompt_len"] for o in report["outputs"]] == [8, 40, 300]
    assert all(len(o["token_ids"]) == 3 for o in report["outputs"])
    # the 300-token prompt again (prefix cache: every token but the last)
    # and into a second engine sharing a disk store (one whole 256-token chunk)
    reuse = report["prefix_reuse"]
    assert reuse["prompt_len"] == 300 and reuse["kv_connector"].startswith("disk:")
    assert reuse["prefix_hit_cached_tokens"] == 299 and reuse["external_hit_tokens"] == 256
    assert reuse["same_tokens"]
