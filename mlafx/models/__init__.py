"""Plain PyTorch DeepSeek-V2/V3-family model (the reference semantics) and its weights."""

from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.loader import build_model
from mlafx.models.step import StepMetadata

__all__ = ["MLAForCausalLM", "StepMetadata", "build_model"]
