"""The bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's
requests, strictly parsed (an unknown field is a 400, as with OpenAI), plus vLLM's
``top_k``, ``min_tokens``, ``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos``.

Every bound here is the engine's (``SamplingParams``): a value the schema admits is one the
engine serves. ``temperature`` defaults to 1 as in OpenAI's API: send 0 for greedy decoding.

Completions: ``prompt`` is one prompt or a list of them; a prompt is text (needs the
model's tokenizer) or a list of token ids. Chat: ``messages`` rendered with the model's chat
template (``runtime/chat_template.py``).
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from mlafx.runtime import SamplingParams
from mlafx.runtime.sampling_params import MAX_SEED, MIN_SEED

TokenIds = list[StrictInt]
PromptInput = StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
MAX_LOGPROBS = 20
MAX_COPIES = 128  # n and best_of
# what a client must send for the fields whose type is a union (for error messages)
FIELD_SHAPES = {
    "prompt": "a string, a list of token ids (integers), a list of strings or a list of "
    "token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints take to sample a completion."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_COPIES)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    min_tokens: int = Field(0, ge=0)
    user: str | None = None  # accepted, unused

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise ValueError("top_k must be -1 (no limit) or at least 1")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def engine_params(
        self,
        max_tokens: int,
        *,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        best_of: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters (its ``ValueError`` names the field at fault)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            n=self.n,
            best_of=best_of,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()} or None,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(SamplingFields):
    """One ``/v1/completions`` call; ``prompts()`` and ``sampling_params()`` turn it into
    what the engine takes."""

    prompt: PromptInput
    max_tokens: int | None = Field(16, ge=0)  # None: up to max_model_len
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_COPIES)
    suffix: str | None = None  # refused when set (see create_completion)

    @model_validator(mode="after")
    def _checks(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 is only allowed with echo=true (prompt logprobs)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot be streamed (the best are known at the end)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, list | str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return [cast(list[int], list(prompt))]  # token ids (or [], which the engine refuses)

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """``max_tokens=None`` means as many as the model length allows (the engine stops
        at ``max_model_len``); ``echo`` with ``logprobs`` scores the prompt too."""
        return self.engine_params(
            max_model_len if self.max_tokens is None else self.max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo else None,
            best_of=self.best_of,
        )


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; extra keys (``name``, ``reasoning_content``, ...) reach the template."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart]

    def template_dict(self) -> dict[str, object]:
        """The message as the template sees it: text parts joined with newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {**self.model_dump(exclude={"content"}), "content": content}


class ChatCompletionRequest(SamplingFields):
    """One ``/v1/chat/completions`` call. ``max_completion_tokens`` (or the older
    ``max_tokens``) bounds the reply; ``add_generation_prompt`` (default true) and
    ``chat_template_kwargs`` go to the template, as in vLLM."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, object] | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        limit = self.max_completion_tokens or self.max_tokens
        return self.engine_params(
            max_model_len if limit is None else limit,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )
