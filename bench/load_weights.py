"""Loading a bf16 checkpoint: time and peak RSS, mapping weights (this tree) against copying them.

    .venv/bin/python bench/load_weights.py [--layout fused|per-expert] [--baseline-tree DIR]
    .venv/bin/mlafx bench load-weights

Writes once, under ``--dir`` (default /tmp/mlafx-load-bench/<layout>), the DeepSeek-V2-Lite
preset shrunk to 4 layers and 8 routed experts (~1.5 GiB in bf16) with seeded dummy weights:
``fused`` as the model's own state_dict (every tensor a whole target in its dtype),
``per-expert`` in the Hub's per-expert layout (routed experts copied into the fused stacks).
Then each row is a fresh process that imports torch and mlafx (and the meta-device code torch
imports on first use, ~1 s in every row) and builds the bf16 model:

    mapped      ``build_model(..., "auto")`` of this tree
    copied      the loader before mapping, inline (fused layout only): every tensor
                materialised with ``to_empty``, each checkpoint tensor copied in from
                ``safe_open(...).get_tensor`` (a view of safetensors' own file mapping)
    baseline    ``build_model`` of ``--baseline-tree`` (e.g. a checkout of the loader before)

each with the page cache warm (the file was just read) and cold (its pages evicted first with
``posix_fadvise(DONTNEED)``, no root needed). Per row: load seconds; peak RSS of the process
(VmHWM) and its RSS after load (anonymous / file-backed), both minus the RSS after imports;
then seconds to read every weight once (one element per 4 KiB page: what a mapped load defers
to the first steps) and the RSS after that. Figures depend on the machine's load: the script
prints /proc/loadavg before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = {"num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2}
DTYPE = "bfloat16"

# One load in a fresh process; prints a JSON line. argv: how ("build" or "copied"), directory.
CHILD = r"""
import json, sys, time
import torch
import mlafx
from mlafx.config import ModelConfig
from mlafx.models.loader import build_model

def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) * 1024
    return fields

how, directory = sys.argv[1], sys.argv[2]
cfg = ModelConfig.from_model(directory)
with torch.device("meta"):  # torch imports its meta-device machinery on first use (~1 s)
    torch.nn.Embedding(2, 2)
imported = status()
start = time.perf_counter()
if how == "copied":
    from safetensors import safe_open
    from mlafx.models.deepseek import MLAForCausalLM
    from mlafx.models.moe import Router
    with torch.device("meta"):
        model = MLAForCausalLM(cfg)
    model.to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, Router):
            module.float()
    model.to_empty(device="cpu")
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad(), safe_open(directory + "/model.safetensors", framework="pt") as f:
        for key in f.keys():
            targets[key].data.copy_(f.get_tensor(key))
else:
    model = build_model(cfg, "bfloat16", "auto", directory, progress=False)
load_s = time.perf_counter() - start
loaded = status()
start = time.perf_counter()
with torch.no_grad():
    for tensor in model.state_dict().values():
        flat = tensor.reshape(-1)
        flat[:: max(1, 4096 // tensor.element_size())].float().sum()
touch_s = time.perf_counter() - start
touched = status()
print(json.dumps({"imported": imported, "loaded": loaded, "touched": touched,
                  "load_s": load_s, "touch_s": touch_s}))
"""


def write_checkpoint(directory: Path, layout: str) -> int:
    """The dummy-weight checkpoint (skipped if already there); returns its size in bytes."""
    file = directory / "model.safetensors"
    if not file.is_file():
        import torch
        from safetensors.torch import save_file

        from mlafx.config import PRESETS, ModelConfig
        from mlafx.models.loader import build_model

        hf = {**PRESETS["deepseek-v2-lite"], **OVERRIDES}
        model = build_model(ModelConfig.from_hf_dict(hf), DTYPE, "dummy", seed=0)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            prefix, _, leaf = name.rpartition(".")
            if layout == "per-expert" and leaf == "gate_up_proj":  # [E, 2I, D]
                for e, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            elif layout == "per-expert" and leaf == "down_proj" and tensor.dim() == 3:
                for e, down in enumerate(tensor):  # [E, D, I]
                    tensors[f"{prefix}.{e}.down_proj.weight"] = down.contiguous()
            else:
                tensors[name] = tensor
        del model
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            save_file(tensors, f"{scratch}/model.safetensors")
            (directory / "config.json").write_text(json.dumps(hf))
            os.replace(f"{scratch}/model.safetensors", file)
    return file.stat().st_size


def evict(file: Path) -> None:
    """Drop the file's clean pages from the page cache (they are not mapped by any process)."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(file: Path) -> None:
    with open(file, "rb") as f:
        while f.read(64 << 20):
            pass


def run(how: str, tree: Path, directory: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, how, str(directory)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,  # ``-c`` puts the working directory first on sys.path
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{how} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _peak(result: dict) -> int:
    return result["loaded"]["VmHWM"] - result["imported"]["VmRSS"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("fused", "per-expert"), default="fused")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=2, help="runs per row; the best is shown")
    parser.add_argument("--remove", action="store_true", help="delete the checkpoint afterwards")
    args = parser.parse_args(argv)
    directory = args.dir or Path("/tmp/mlafx-load-bench") / args.layout
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    size = write_checkpoint(directory, args.layout)
    file = directory / "model.safetensors"
    rows = [("mapped", ROOT)]
    if args.layout == "fused":
        rows.append(("copied", ROOT))
    if args.baseline_tree is not None:
        rows.append(("baseline", args.baseline_tree.resolve()))
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}")
    print(f"{args.layout} bf16 checkpoint {size / 2**30:.2f} GiB at {file}; MiB are over the RSS")
    print("after imports; best of", args.repeat, "fresh processes per row")
    header = (
        f"{'':16} {'load s':>7} {'peak MiB':>9} {'anon MiB':>9} {'file MiB':>9} "
        f"{'touch s':>8} {'RSS after touch':>16}"
    )
    print(header)
    results: dict[tuple[str, str], dict] = {}
    for cache in ("warm", "cold"):
        for how, tree in rows:
            best = None
            for _ in range(args.repeat):
                if cache == "cold":
                    evict(file)
                else:
                    warm(file)
                result = run("copied" if how == "copied" else "build", tree, directory)
                if best is None or result["load_s"] < best["load_s"]:
                    best = result
            assert best is not None
            results[(how, cache)] = best
            base = best["imported"]["VmRSS"]
            loaded, touched = best["loaded"], best["touched"]
            mib = 2**20
            print(
                f"{how + ' ' + cache:16} {best['load_s']:7.2f} "
                f"{_peak(best) / mib:9.0f} "
                f"{(loaded['RssAnon'] - best['imported']['RssAnon']) / mib:9.0f} "
                f"{(loaded['RssFile'] - best['imported']['RssFile']) / mib:9.0f} "
                f"{best['touch_s']:8.2f} {(touched['VmRSS'] - base) / mib:16.0f}"
            )
    for cache in ("warm", "cold"):
        mapped = results[("mapped", cache)]
        for how, _ in rows[1:]:
            other = results[(how, cache)]
            load = other["load_s"] / mapped["load_s"]
            total = (other["load_s"] + other["touch_s"]) / (mapped["load_s"] + mapped["touch_s"])
            print(
                f"{cache}: {how} / mapped: load time {load:.1f}x, load + touch {total:.2f}x, "
                f"peak RSS {_peak(other) / 2**20:.0f} vs {_peak(mapped) / 2**20:.0f} MiB"
            )
    print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")
    if args.remove:
        shutil.rmtree(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
