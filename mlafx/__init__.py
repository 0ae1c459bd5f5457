"""mlafx: a graph-compiled CPU inference runtime for MLA language models."""

from mlafx import export  # callable: mlafx.export(model, output, format) writes an artifact
from mlafx.runtime import LLM, CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__", "export"]
