"""A DeepSeek-V4 model for the engine: its checkpoint's weights (``checkpoint.py``) or seeded
dummy ones, and how many bytes either takes in memory before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import torch

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.checkpoint import FLOAT32_NAMES, in_memory_name, load_deepseek_v4
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.safetensors_file import tensor_locations
from mlafx.models.weights import checkpoint_files, init_dummy_weights

_FLOAT_CODES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def build_deepseek_v4(
    cfg: DeepseekV4Config, dtype: torch.dtype, model_dir: str | Path | None, seed: int = 0
) -> DeepseekV4ForCausalLM:
    """The checkpoint in ``model_dir`` (its own config), or with ``model_dir`` None dummy
    weights for ``cfg``: ``init_dummy_weights``' (norms 1, biases 0, the rest normal(0,
    0.02)), the hash layers' ``tid2eid`` drawn uniformly, every tensor seeded by ``seed`` and
    its name; float32 where transformers keeps float32 (``checkpoint.FLOAT32_NAMES``)."""
    if model_dir is not None:
        return load_deepseek_v4(model_dir, dtype)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)

    def to_dtype(names: list[str], tensor: torch.Tensor) -> None:  # one tensor at a time
        if not FLOAT32_NAMES.search(names[0]):
            tensor.data = tensor.data.to(dtype)

    init_dummy_weights(model, seed=seed, on_filled=to_dtype)
    generator = torch.Generator().manual_seed(seed)
    hashed = [(n, b) for n, b in model.named_buffers() if n.endswith("tid2eid")]
    for name, table in hashed:  # integer buffers: init_dummy_weights fills floats only
        parent, _, leaf = name.rpartition(".")
        ids = torch.randint(0, cfg.n_routed_experts, table.shape, generator=generator)
        model.get_submodule(parent)._buffers[leaf] = ids.to(table.dtype)
    for module in model.modules():
        if isinstance(module, V4RotaryEmbedding):
            module.inv_freq = module.frequencies()
    return model.eval()


def deepseek_v4_weight_bytes(
    cfg: DeepseekV4Config, dtype: torch.dtype, model_dir: str | Path | None
) -> int:
    """Bytes the model's weights take once built: quantized tensors at their stored size,
    the rest at ``dtype``'s (float32 where kept float32); read from the checkpoint's headers
    (``model_dir``) or counted on a model built on the meta device (dummy weights)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if model_dir is None:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg)
        return sum(
            p.numel() * (4 if FLOAT32_NAMES.search(n) else size)
            for n, p in model.named_parameters()
        )
    total = 0
    for file in checkpoint_files(Path(model_dir)):
        for key, stored in tensor_locations(file).items():
            if stored.dtype not in _FLOAT_CODES:  # FP8 / FP4 / ue8m0 / integer: as stored
                total += stored.length
                continue
            numel = stored.length // _FLOAT_CODES[stored.dtype]
            total += numel * (4 if FLOAT32_NAMES.search(in_memory_name(key)) else size)
    return total
