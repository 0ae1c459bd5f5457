"""What a request asks for (``SamplingParams``) and what it gets back (``RequestOutput``),
shaped like vLLM's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature a request is decoded greedily (as vLLM does): dividing logits by it
# would overflow float32 and the distribution is a point mass on the argmax anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range is [-2**63, 2**64)
MIN_SEED = -(2**63)


@dataclass(frozen=True)
class SamplingParams:
    """What one prompt asks for, with vLLM's names.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy. ``logprobs=k``
    returns, per generated token, the top-k token ids (always including the chosen one) with
    their log-probabilities under the model's raw distribution (before penalties, bias,
    temperature, top-k and top-p); ``prompt_logprobs=k`` the same for every prompt token
    but the first (whose entry is None): such a prompt is computed whole, never read from
    the prefix cache. ``max_tokens=0`` computes the prompt only (for its logprobs).

    ``n`` completions of the prompt are returned (``best_of >= n`` are generated and the
    ``n`` with the highest cumulative logprob kept); the copies after the first wait for its
    prompt and read it from the prefix cache. With a ``seed``, copy ``i`` draws from
    ``seed + i``.

    Logit processing, in this order: ``repetition_penalty`` (over prompt and output tokens:
    a positive logit divided by it, a negative one multiplied), ``frequency_penalty`` and
    ``presence_penalty`` (over output tokens: minus ``count * frequency + presence``),
    ``logit_bias`` (token id -> added value), and eos / ``stop_token_ids`` masked until
    ``min_tokens`` tokens exist."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None  # None or -1: no limit
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None  # None: n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be None, -1 or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 100:  # NaN and inf fail too
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {bias}")
            object.__setattr__(
                self, "logit_bias", {int(t): float(b) for t, b in self.logit_bias.items()}
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_copies(self) -> int:
        """Completions generated (``best_of``, or ``n``)."""
        return self.best_of or self.n

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias or min_tokens changes the logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


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
    # "stop" (eos or a stop token), "length", "abort" or "error" (see RequestOutput.error)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    error: str | None = None  # why it ended with finish_reason "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens not computed: prefix-cache hits + external loads
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # prompt_logprobs: per prompt token, top-k ids (with the token's own) -> logprob; the
    # first token's entry is None
    prompt_logprobs: list[dict[int, float] | None] | None = None
