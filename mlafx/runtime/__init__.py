"""Serving: paged latent cache, block allocator, scheduler, engine loop, sampler."""

from mlafx.runtime.engine import LLM
from mlafx.runtime.sampling_params import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
