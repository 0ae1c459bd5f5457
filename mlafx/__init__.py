"""mlafx: a graph-compiled CPU inference runtime for MLA language models."""

from mlafx.runtime import LLM, CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
