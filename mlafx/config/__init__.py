"""Model configuration: HF ``config.json`` (+ ``hf_overrides``) or a preset -> ModelConfig."""

from mlafx.config.memory import (
    check_fits_in_memory,
    kv_bytes_per_block,
    kv_bytes_per_token,
    weight_bytes,
)
from mlafx.config.model_config import (
    ConfigError,
    LongRopeScaling,
    ModelConfig,
    YarnScaling,
    yarn_mscale,
)
from mlafx.config.presets import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES, PRESETS
from mlafx.config.served_config import ServedConfig

__all__ = [
    "ConfigError",
    "EMBEDDED_DEFAULT_MODEL",
    "EMBEDDED_DEFAULT_OVERRIDES",
    "ModelConfig",
    "PRESETS",
    "ServedConfig",
    "LongRopeScaling",
    "YarnScaling",
    "check_fits_in_memory",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "weight_bytes",
    "yarn_mscale",
]
