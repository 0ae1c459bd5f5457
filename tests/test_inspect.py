"""`mlafx inspect`: the JSON report and the self-contained HTML report (rendered in Chromium)."""

from __future__ import annotations

import json
import subprocess
import tempfile

from mlafx.cli import main
from tests.system_tools import require
from tests.tiny_models import TINY_OVERRIDES

DENSE = json.dumps({**TINY_OVERRIDES, "n_routed_experts": 0})
MODEL_FLAGS = ["--hf-overrides", DENSE, "--dtype", "float32", "--block-size", "4"]


def test_inspect_json_lists_one_site_per_layer_and_the_ops_it_lowered_to(capsys):
    assert main(["inspect", *MODEL_FLAGS, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["layer"] for s in report["sites"]] == [0, 1]
    for site in report["sites"]:
        assert site["lowered_to"] == [
            "mlafx::write_latent_cache",
            "mlafx::batched_matmul",
            "mlafx::mla_attention_paged",
            "mlafx::varlen_attention",
            "mlafx::merge_attn_states",
        ]
        # the absorbed passes: q_nope W_UK, attention over the cache, out_lat W_UV^T
        absorbed = ["mlafx::batched_matmul", "mlafx::mla_attention_paged", "mlafx::batched_matmul"]
        assert site["paths"] == {
            "cache_write": ["mlafx::write_latent_cache"],
            "absorbed": absorbed,
            "split": ["mlafx::varlen_attention", *absorbed, "mlafx::merge_attn_states"],
        }
    assert report["verify"]["ok"] and report["refused"] == []
    coverage = report["verify"]["sample_coverage"]
    assert coverage["absorbed_prefills_with_context"] and coverage["split_prefills_with_context"]
    names = [s["name"] for s in report["stages"]]
    assert names == ["captured", "find_mla_attention", "lower_attention", "lower_linears", "verify"]
    diff = report["stages"][2]["diff_from_previous"]
    assert diff["aten.scaled_dot_product_attention.default"] == -2
    assert diff["aten.index_copy_.default"] == -2
    assert diff["mlafx.write_latent_cache.default"] == 2
    assert diff["mlafx.mla_attention_paged.default"] == 4
    assert diff["mlafx.varlen_attention.default"] == 2
    assert diff["mlafx.merge_attn_states.default"] == 2
    # per layer q, kv_a, o, the split path's kv_b decompression and the dense MLP's three;
    # and lm_head
    linears = report["stages"][3]["diff_from_previous"]
    assert linears["mlafx.linear_packed.default"] == 2 * 7 + 1 == -linears["aten.linear.default"]


def test_inspect_text_shows_one_stage_with_its_graph(capsys):
    assert main(["inspect", *MODEL_FLAGS, "--stage", "lower_attention"]) == 0
    out = capsys.readouterr().out
    assert "== stage lower_attention" in out and "== stage captured" not in out
    assert "torch.ops.mlafx.mla_attention_paged.default(" in out
    assert "torch.ops.mlafx.varlen_attention.default(" in out
    assert (
        "absorbed rows: mlafx::batched_matmul + mlafx::mla_attention_paged + "
        "mlafx::batched_matmul; split rows: mlafx::varlen_attention" in out
    )


def test_inspect_html_renders_every_stage_in_headless_chromium(tmp_path, capsys):
    require("dot")
    chromium = require("chromium")
    page = tmp_path / "report.html"
    assert main(["inspect", *MODEL_FLAGS, "--html", str(page)]) == 0
    text = page.read_text()
    assert "<script" not in text and "http://" not in text.replace("http://www.w3.org", "")
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--dump-dom",
                page.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    for stage in ("captured", "find_mla_attention", "lower_attention", "verify"):
        assert f'id="stage-{stage}"' in dom
    assert dom.count("<svg") >= 4 and "mlafx::mla_attention_paged" in dom
    assert "split rows: mlafx::varlen_attention + mlafx::batched_matmul" in dom
