"""Checkpoint tensors already in the target's dtype and shape are mapped from the file, not
copied (``mlafx.models.weights``, ``mlafx.models.safetensors_file``).

A tensor counts as mapped when its bytes lie inside a private mapping of the checkpoint file
listed in ``/proc/self/maps``; a copied one lies outside every mapping of the file.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import mlafx
from mlafx.models import weights
from mlafx.models.loader import build_model
from tests.test_weights import _load, _save_fused, _v2, _v3, _zeroed_like
from tests.tiny_models import TINY_OVERRIDES, write_tiny_checkpoint


def _file_mappings(file: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of every mapping of ``file`` in this process."""
    real = os.path.realpath(file)
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.append((lo, hi, fields[1]))
    return found


def _mapped_from(tensor: torch.Tensor, file: Path) -> bool:
    """Whether all of ``tensor``'s bytes lie in one private mapping of ``file``."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return any(
        lo <= start and end <= hi and perms.endswith("p") for lo, hi, perms in _file_mappings(file)
    )


def _file_tensors(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def test_whole_tensors_are_mapped_and_equal_the_file(tmp_path: Path) -> None:
    model = _v3()
    _save_fused(model, tmp_path)
    file = tmp_path / "model.safetensors"
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    stored = _file_tensors(file)
    for key, tensor in fresh.state_dict().items():
        assert _mapped_from(tensor, file), key
        assert torch.equal(tensor, stored[key]), key


def test_casts_and_fused_experts_are_copied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _v3()
    model.save_pretrained(tmp_path)  # fp32, per-expert
    file = tmp_path / "model.safetensors"
    fresh = _zeroed_like(model).to(torch.bfloat16)
    gate = fresh.model.layers[1].mlp.gate
    gate.weight = nn.Parameter(gate.weight.float())  # the mlafx model keeps its router in fp32
    gate.e_score_correction_bias = gate.e_score_correction_bias.float()
    with caplog.at_level(logging.INFO, logger=weights.__name__):
        _load(fresh, tmp_path)
    sd = fresh.state_dict()
    for key in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        assert sd[key].dtype == torch.float32 and _mapped_from(sd[key], file), key
    copied = [k for k in sd if not k.startswith("model.layers.1.mlp.gate.")]
    for key in copied:  # bf16 targets of an fp32 file, and the fused experts
        assert sd[key].dtype == torch.bfloat16 and not _mapped_from(sd[key], file), key
    want = model.state_dict()
    for key, value in sd.items():
        torch.testing.assert_close(value, want[key].to(value.dtype), rtol=0, atol=0, msg=key)
    # layer 1's 2 fused expert tensors are filled by 3 per-expert tensors of each of 4 experts
    n_copied = len(copied) - 2 + 3 * 4
    assert f"2 tensors (0.0 MiB) mapped from the file, {n_copied} copied" in caplog.text


def test_truncated_expert_rows_are_copied(tmp_path: Path) -> None:
    big = _v3(n_routed_experts=8)
    _save_fused(big, tmp_path)
    file = tmp_path / "model.safetensors"
    small = _zeroed_like(_v3(n_routed_experts=4))
    _load(small, tmp_path)
    for key, value in small.state_dict().items():
        truncated = ".mlp.gate." in key or ".mlp.experts." in key
        assert _mapped_from(value, file) != truncated, key
        want = big.state_dict()[key]
        torch.testing.assert_close(value, want[:4] if truncated else want, rtol=0, atol=0)


def _misalign(file: Path, by: int) -> None:
    """Pad the JSON header so that the data starts ``by`` bytes past a multiple of 8."""
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n].rstrip(b" ")
    padded = header + b" " * ((by - len(header)) % 8)
    file.write_bytes(struct.pack("<Q", len(padded)) + padded + data[8 + n :])


def test_misaligned_tensors_are_copied(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _v2()
    _save_fused(model, tmp_path)
    file = tmp_path / "model.safetensors"
    _misalign(file, 2)  # every fp32 tensor now starts 2 bytes past a multiple of 4
    fresh = _zeroed_like(model)
    with caplog.at_level(logging.DEBUG, logger=weights.__name__):
        _load(fresh, tmp_path)
    assert "not a multiple of its 4-byte elements" in caplog.text
    assert " 0 tensors (0.0 MiB) mapped from the file" in caplog.text
    stored = _file_tensors(file)
    for key, tensor in fresh.state_dict().items():
        assert not _mapped_from(tensor, file), key
        assert tensor.data_ptr() % 4 == 0, key
        assert torch.equal(tensor, stored[key]), key


def test_a_write_into_a_mapped_weight_stays_out_of_the_file(tmp_path: Path) -> None:
    model = _v2()
    _save_fused(model, tmp_path)
    file = tmp_path / "model.safetensors"
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    weight = fresh.model.embed_tokens.weight
    assert _mapped_from(weight, file)
    with torch.no_grad():
        weight.add_(1.0)  # copy-on-write: this process's own pages
    want = model.model.embed_tokens.weight.detach() + 1
    torch.testing.assert_close(weight.detach(), want, rtol=0, atol=0)
    assert hashlib.sha256(file.read_bytes()).hexdigest() == digest
    again = _zeroed_like(model)
    _load(again, tmp_path)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_a_replaced_weight_is_unmapped(tmp_path: Path) -> None:
    """Each tensor has its own mapping: dropping one gives its pages back at once."""
    model = _v2()
    _save_fused(model, tmp_path)
    file = tmp_path / "model.safetensors"
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    old = fresh.lm_head.weight
    start, nbytes = old.data_ptr(), old.numel() * old.element_size()
    assert _mapped_from(old, file)
    del old
    fresh.lm_head.weight = nn.Parameter(torch.zeros_like(fresh.lm_head.weight))
    gc.collect()
    assert not any(lo < start + nbytes and start < hi for lo, hi, _ in _file_mappings(file))
    assert _mapped_from(fresh.model.embed_tokens.weight, file)  # the others stay mapped
    del fresh
    gc.collect()
    assert _file_mappings(file) == []


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_build_model_maps_every_tensor_of_its_own_dtype(tmp_path: Path, tie: bool) -> None:
    cfg = write_tiny_checkpoint(tmp_path, "bfloat16", tie_word_embeddings=tie)
    model = build_model(cfg, "bfloat16", "auto", tmp_path, progress=False)
    file = tmp_path / "model.safetensors"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    dummy = build_model(cfg, "bfloat16", "dummy", seed=0)
    for key, tensor in model.state_dict().items():
        assert _mapped_from(tensor, file), key  # the fp32 router included: the file has fp32
        assert not tensor.requires_grad, key
        assert torch.equal(tensor, dummy.state_dict()[key]), key
    assert not model.rope_inv_freq.is_meta


@pytest.mark.parametrize(
    ("dtype", "compiled"),
    [("float32", False), ("bfloat16", False), ("bfloat16", True)],
    ids=["float32", "bfloat16", "bfloat16-compiled"],
)
def test_engine_on_a_mapped_checkpoint_generates_as_on_the_same_weights_in_memory(
    tmp_path: Path, dtype: str, compiled: bool
) -> None:
    """The compiled step reads the mapped weights too (AOTInductor constants, user-managed:
    pointers into the mappings, aligned to their element size, not to 64 bytes as allocations)."""
    write_tiny_checkpoint(tmp_path, dtype)
    options = dict(dtype=dtype, block_size=4, num_kv_blocks=64, progress=False, compile=compiled)
    mapped = mlafx.LLM(str(tmp_path), **options)
    in_memory = mlafx.LLM(
        "deepseek-v2-lite", load_format="dummy", hf_overrides=TINY_OVERRIDES, seed=0, **options
    )
    # the embedding stays as it lies in the file; a compiled engine reads lm_head only as the
    # packed copy derived from it, and drops its own reference to the mapped source
    file = tmp_path / "model.safetensors"
    assert _mapped_from(mapped.model.model.embed_tokens.weight, file)
    assert mapped.model.lm_head.weight.is_meta == compiled
    if not compiled:
        assert _mapped_from(mapped.model.lm_head.weight, file)
    prompts = [[3, 14, 15, 92, 65], list(range(2, 40))]
    params = mlafx.SamplingParams(max_tokens=12, logprobs=1)
    got = mapped.generate(prompts, params)
    want = in_memory.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
