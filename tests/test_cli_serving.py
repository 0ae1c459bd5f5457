"""`mlafx run`'s serving flags: chunked prefill, prefix caching, KV connector, metrics."""

from __future__ import annotations

import json

from mlafx.cli import main
from tests.tiny_models import TINY_OVERRIDES

PROMPT = ",".join(str(t) for t in range(2, 26))  # 24 tokens


def run(capsys, *flags: str) -> tuple[int, str, str]:
    code = main(
        [
            "run",
            "--no-compile",
            "--hf-overrides",
            json.dumps(TINY_OVERRIDES),
            "--dtype",
            "float32",
            "--block-size",
            "4",
            "--num-kv-blocks",
            "64",
            "--max-tokens",
            "3",
            "--prompt-token-ids",
            PROMPT,
            "--prompt-token-ids",
            PROMPT,
            *flags,
        ]
    )
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chunked_run_reports_a_prefix_hit_and_metrics(capsys):
    # an 8-token budget: the first prompt takes 3 chunked steps, the second is admitted
    # after them and finds its first 5 blocks cached, then 3 rows of the first's last block
    # (a partial-block hit: every token but its last)
    code, out, _ = run(capsys, "--max-num-batched-tokens", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert [o["num_cached_tokens"] for o in report["outputs"]] == [0, 23]
    assert report["outputs"][0]["token_ids"] == report["outputs"][1]["token_ids"]
    assert all(o["ttft_s"] > 0 and o["tpot_s"] > 0 for o in report["outputs"])
    metrics = report["metrics"]
    assert metrics["prefix_cache_hit_rate"] == 23 / 48 and metrics["num_preemptions"] == 0
    assert metrics["prompt_tokens_per_s"] > 0 and metrics["generation_tokens_per_s"] > 0
    code, out, _ = run(capsys, "--max-num-batched-tokens", "8")
    assert code == 0 and "(24 tokens, 23 cached)" in out
    assert "prefix cache hit rate 47.9%" in out and "0 preemptions" in out


def test_prefix_caching_can_be_turned_off(capsys):
    code, out, _ = run(
        capsys, "--max-num-batched-tokens", "8", "--no-enable-prefix-caching", "--json"
    )
    assert code == 0
    assert [o["num_cached_tokens"] for o in json.loads(out)["outputs"]] == [0, 0]


def test_a_bad_kv_connector_is_a_start_up_error(capsys):
    code, _, err = run(capsys, "--kv-connector", "s3://bucket")
    assert code == 2 and "mlafx run: error:" in err and "s3://bucket" in err


def test_batch_invariant_flag(capsys):
    code, _, err = run(capsys, "--batch-invariant")  # with the reference model: refused
    assert code == 2 and "batch_invariant needs compile=True" in err
    code, out, _ = run(capsys, "--compile", "--batch-invariant", "--no-enable-prefix-caching",
                       "--max-num-batched-tokens", "8", "--json")  # fmt: skip
    assert code == 0
    first, second = json.loads(out)["outputs"]  # chunked at other boundaries, the same tokens
    assert first["token_ids"] == second["token_ids"]
