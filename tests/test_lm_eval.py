"""EleutherAI's lm-eval harness (its ``local-completions`` model) against a running server:
a multiple-choice (loglikelihood) task and a ``generate_until`` task over the data in
``tests/lm_eval_tasks/``; the loglikelihoods it reports are the engine's own prompt
logprobs of the same tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import mlafx
from tests.live_server import live_server
from tests.tiny_models import write_tiny_chat_checkpoint

MODEL = "tiny-eval"
DATA = Path(__file__).parent / "lm_eval_tasks"
TASKS = {
    "mlafx_tiny_mc": """
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "mlafx_tiny_gen": """
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["w9"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
""",
}


def write_tasks(directory: Path) -> None:
    for name, body in TASKS.items():
        data = DATA / f"{name.removeprefix('mlafx_')}.jsonl"
        header = (
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data}\ntest_split: test\n"
        )
        (directory / f"{name}.yaml").write_text(header + body)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_chat_checkpoint(tmp_path_factory.mktemp("tiny_eval"))


def test_lm_eval_tasks_run_and_report_the_engine_logprobs(checkpoint, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    llm = mlafx.LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=256, compile=False, progress=False
    )
    with live_server(llm, MODEL) as url:
        results = simple_evaluate(
            model="local-completions",
            model_args={
                "base_url": f"{url}/v1/completions",
                "model": MODEL,
                "tokenizer_backend": "huggingface",
                "tokenizer": str(checkpoint),
                "num_concurrent": 1,
                "max_retries": 1,
            },
            tasks=list(TASKS),
            task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True,
        )
    for name in TASKS:
        assert results["results"][name], name
    offline = mlafx.LLM(
        str(checkpoint), dtype="float32", num_kv_blocks=256, compile=False, progress=False
    )
    tokenizer = offline.tokenizer
    samples = results["samples"]["mlafx_tiny_mc"]
    assert len(samples) == 3
    for sample in samples:
        assert len(sample["arguments"]) == len(sample["doc"]["choices"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"], strict=True):
            loglikelihood = resp[0][0]
            ids = tokenizer.encode(context + continuation).ids
            num_context = len(tokenizer.encode(context).ids)
            want = offline.generate([ids], mlafx.SamplingParams(max_tokens=0, prompt_logprobs=0))
            scores = want[0].prompt_logprobs
            expected = sum(scores[i][ids[i]] for i in range(num_context, len(ids)))
            assert math.isclose(loglikelihood, expected, abs_tol=1e-4), (context, continuation)
    generations = results["samples"]["mlafx_tiny_gen"]
    assert len(generations) == 2
    for sample in generations:
        context = sample["arguments"][0][0]
        text = (
            offline.generate([context], mlafx.SamplingParams(max_tokens=6, ignore_eos=False))[0]
            .outputs[0]
            .text
        )
        assert sample["resps"][0][0] == text.split("w9")[0], json.dumps(sample["resps"])
