"""What a request asks for (``SamplingParams``) and what it gets back (``RequestOutput``),
shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """``temperature=0`` is greedy. ``logprobs=k`` returns, per generated token, the top-k
    token ids (always including the chosen one) with their log-probabilities under the
    model's raw distribution (before temperature, top-k and top-p)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None  # None or -1: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be None, -1 or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter``) of a request's milestones, and what the
    serving cost it (``num_output_tokens`` generated so far, ``num_preemptions``)."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (None before it)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between consecutive generated tokens after the first (None until a
        second token exists)."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None  # "stop" (eos or a stop token), "length" or "abort"
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed: prefix-cache hits + external loads
    metrics: RequestMetrics | None = field(default=None, repr=False)
