"""The body of ``POST /v1/completions``: OpenAI's legacy completions request, strictly
parsed (an unknown field is a 400, as with OpenAI), plus vLLM's ``top_k``,
``stop_token_ids`` and ``ignore_eos``.

``prompt`` is one prompt or a list of them; a prompt is text (needs the model's
``tokenizer.json``) or a list of token ids. ``temperature`` defaults to 1 as in OpenAI's API:
send 0 for greedy decoding.
"""

from __future__ import annotations

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

TokenIds = list[StrictInt]
PromptInput = StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
MAX_LOGPROBS = 20
# what a client must send for the fields whose type is a union (for error messages)
FIELD_SHAPES = {
    "prompt": "a string, a list of token ids (integers), a list of strings or a list of "
    "token-id lists",
    "stop": "a string or a list of strings",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class CompletionRequest(BaseModel):
    """One ``/v1/completions`` call; ``prompts()`` and ``sampling_params()`` turn it into
    what the engine takes."""

    model_config = ConfigDict(extra="forbid")

    prompt: PromptInput
    model: str | None = None
    max_tokens: int | None = Field(16, ge=1)  # None: up to max_model_len
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1

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

    @field_validator("n")
    @classmethod
    def _n(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (send the prompt several times instead)")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> CompletionRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, list | str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        return [list(prompt)]  # token ids (or [], which the engine refuses as empty)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_model_len: int) -> SamplingParams:
        """The engine's parameters; ``max_tokens=None`` means as many as the model length
        allows (the engine stops at ``max_model_len``)."""
        return SamplingParams(
            max_tokens=max_model_len if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
        )
