"""mlafx: a graph-compiled CPU inference runtime for MLA language models."""
# ruff: noqa: E402  (the waiting policy must be set before anything below loads torch)

from mlafx.openmp_waiting import apply_engine_policy

apply_engine_policy()  # libgomp reads its waiting policy once, when torch loads it

from mlafx import export  # callable: mlafx.export(model, output, format) writes an artifact
from mlafx.runtime import LLM, CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__", "export"]
