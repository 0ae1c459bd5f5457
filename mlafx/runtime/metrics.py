"""Engine-wide counters behind ``LLM.get_metrics()``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Cumulative since the engine started. A request's prompt is looked up in the prefix
    cache and the KV store once, when it is first admitted (a preempted request's
    re-admission is not counted again)."""

    num_requests: int = 0  # admitted at least once
    num_finished_requests: int = 0
    num_aborted_requests: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    lookup_prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefix_cache_hit_tokens: int = 0  # of those, found in the local prefix cache
    external_hit_tokens: int = 0  # of those, loaded from the KV connector
    computed_prompt_tokens: int = 0  # prompt positions the steps computed (recompute included)
    generation_tokens: int = 0  # tokens sampled
    busy_seconds: float = 0.0  # wall time inside step()

    def as_dict(self, num_free_blocks: int, num_usable_blocks: int) -> dict[str, float]:
        """The flat dict of ``LLM.get_metrics()``; rates are 0.0 before there is anything
        to divide by."""

        def ratio(a: float, b: float) -> float:
            return a / b if b else 0.0

        return {
            "num_requests": self.num_requests,
            "num_finished_requests": self.num_finished_requests,
            "num_aborted_requests": self.num_aborted_requests,
            "num_preemptions": self.num_preemptions,
            "num_steps": self.num_steps,
            "prompt_tokens": self.lookup_prompt_tokens,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_hit_rate": ratio(self.prefix_cache_hit_tokens, self.lookup_prompt_tokens),
            "external_hit_tokens": self.external_hit_tokens,
            "external_cache_hit_rate": ratio(self.external_hit_tokens, self.lookup_prompt_tokens),
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "busy_s": self.busy_seconds,
            "prompt_tokens_per_s": ratio(self.computed_prompt_tokens, self.busy_seconds),
            "generation_tokens_per_s": ratio(self.generation_tokens, self.busy_seconds),
            "kv_cache_usage": ratio(num_usable_blocks - num_free_blocks, num_usable_blocks),
        }
