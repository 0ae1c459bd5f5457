"""One request's state while the engine serves it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mlafx.runtime.sampling_params import RequestMetrics, SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    prompt_text: str | None = None
    generator: torch.Generator | None = None  # seeded per request when sampling
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    blocks: list[int] = field(default_factory=list)  # KV blocks, in position order
    num_computed_tokens: int = 0  # tokens whose latent rows are in the cache
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``start .. end-1`` of prompt + output."""
        num_prompt = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:end] if start < num_prompt else []) + (
            self.output_token_ids[max(start - num_prompt, 0) : max(end - num_prompt, 0)]
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
