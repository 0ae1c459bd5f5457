"""A dummy checkpoint in DeepSeek's block FP8 layout, written tensor by tensor, for
``mlafx bench e2e --quantization fp8``: every ``*_proj`` linear (per-expert keys, as DeepSeek
ships them) as ``weight`` F8_E4M3 + ``weight_scale_inv`` F32 per 128 x 128 block, the router,
norms, embeddings and lm_head in bf16, ``quantization_config: {quant_method: fp8}``. One shard
per layer, so writing holds one layer's tensors at a time (~0.6 GB at V2-Lite's widths).

Weights are normal(0, 0.02) quantized by ``kernels.fp8_format.quantize_fp8`` (as DeepSeek's
own quantizer), norms 1, the correction bias 0: the values ``init_dummy_weights`` draws.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mlafx.config import ModelConfig
from mlafx.config.model_config import load_hf_config_dict
from mlafx.kernels.fp8_format import quantize_fp8
from mlafx.models.deepseek import MLAForCausalLM

BLOCK = (128, 128)
_LIBC = ctypes.CDLL("libc.so.6")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * 0.02


def _layer_tensors(named: list[tuple[str, torch.Tensor]], generator: torch.Generator) -> dict:
    """Checkpoint tensors of one shard's model tensors (meta, for their names and shapes)."""
    out: dict[str, torch.Tensor] = {}

    def linear(key: str, shape: tuple[int, int]) -> None:
        q, scale = quantize_fp8(_normal(shape, generator), BLOCK)
        out[f"{key}.weight"], out[f"{key}.weight_scale_inv"] = q, scale

    for name, tensor in named:
        fused = _FUSED.match(name)
        if fused is not None:
            stack, which = fused.groups()
            e, rows, cols = tensor.shape
            for expert in range(e):
                if which == "down_proj":
                    linear(f"{stack}.{expert}.down_proj", (rows, cols))
                else:
                    linear(f"{stack}.{expert}.gate_proj", (rows // 2, cols))
                    linear(f"{stack}.{expert}.up_proj", (rows // 2, cols))
        elif name.endswith("_proj.weight"):
            linear(name.removesuffix(".weight"), tuple(tensor.shape))
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(tensor.shape, dtype=torch.bfloat16)
        elif name.endswith("e_score_correction_bias"):
            out[name] = torch.zeros(tensor.shape, dtype=torch.float32)
        else:  # embeddings, lm_head, the router
            out[name] = _normal(tuple(tensor.shape), generator).to(torch.bfloat16)
    return out


def write_fp8_checkpoint(
    model: str, hf_overrides: dict[str, Any], directory: Path, *, seed: int = 0
) -> Path:
    """``model`` (a preset or directory) with ``hf_overrides`` as a dummy FP8 checkpoint in
    ``directory`` (reused when its config already matches); returns ``directory``."""
    raw = {**load_hf_config_dict(model), **hf_overrides}
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    raw["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    config_file = directory / "config.json"
    index_file = directory / "model.safetensors.index.json"
    if config_file.is_file() and index_file.is_file():
        if json.loads(config_file.read_text()) == raw:
            return directory
    directory.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(raw)
    with torch.device("meta"):
        meta = MLAForCausalLM(cfg)
    shards: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in meta.state_dict().items():
        if name == "rope_inv_freq":
            continue
        layer = _LAYER.match(name)
        shard = f"layer-{int(layer.group(1)):03d}" if layer else "embeddings"
        shards.setdefault(shard, []).append((name, tensor))
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for shard, named in tqdm(sorted(shards.items()), desc="writing fp8 checkpoint", unit="shard",
                             file=sys.stderr):  # fmt: skip
        tensors = _layer_tensors(named, generator)
        file = f"{shard}.safetensors"
        save_file(tensors, str(directory / file))
        weight_map |= dict.fromkeys(tensors, file)
        del tensors
        _LIBC.malloc_trim(0)  # the shard's (< 32 MB) tensors stay in glibc's heap otherwise
    index_file.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_file.write_text(json.dumps(raw))  # last: a complete checkpoint is one with a config
    return directory


def write_in_subprocess(model: str, hf_overrides: dict[str, Any], directory: Path) -> Path:
    """``write_fp8_checkpoint`` in a child process: whatever its allocator keeps is returned
    to the OS before the engine that serves the checkpoint loads it. Then every dirty page is
    written out (``os.sync``): timed straight after the write, the full preset's decode took
    1.4x as long while the 15 GB were still being written back (7 Dec 2026)."""
    args = [sys.executable, "-m", "bench.e2e.fp8_checkpoint", model, json.dumps(hf_overrides),
            str(directory)]  # fmt: skip
    subprocess.run(args, check=True, cwd=Path(__file__).resolve().parents[2])
    os.sync()
    return directory


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="write a dummy DeepSeek-layout FP8 checkpoint")
    parser.add_argument("model")
    parser.add_argument("hf_overrides", type=json.loads)
    parser.add_argument("directory", type=Path)
    cli = parser.parse_args()
    write_fp8_checkpoint(cli.model, cli.hf_overrides, cli.directory)
