"""One choice of a completion, built up from the engine's cumulative outputs.

The engine reports each request's whole output so far (token ids, decoded text,
per-token logprobs) after every step that drew a token. ``ChoiceState.update`` turns that
into the part not sent yet, a ``ChoiceDelta``, applying the rules a client sees:

- stop strings: the text ends just before the first match of any of them, and the choice
  finishes with ``finish_reason="stop"`` (the caller then aborts the engine request);
  ``token_ids`` and logprobs still list every token generated, the matching one included;
- text not yet safe to send is held back: a tail that may be the start of a stop string,
  or that ends in U+FFFD (a multi-byte character whose remaining bytes come with the next
  token); a finished choice sends all it has;
- logprobs in OpenAI's completions layout: ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (token string -> logprob) and ``text_offset``, with a token shown as its
  decoded text, or ``token_id:N`` without a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlafx.runtime import RequestOutput


@dataclass
class ChoiceDelta:
    """What a choice gained since the last update."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None


@dataclass
class ChoiceState:
    """The sent part of one choice. ``tokenizer`` is the model's (None: token ids only)."""

    stop: list[str]
    tokenizer: Any | None
    want_logprobs: bool
    sent_text: str = ""
    num_tokens: int = 0  # token ids (and logprob entries) already sent
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    _text_offset: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: RequestOutput) -> ChoiceDelta:
        """The delta since the last update; call only while not ``finished``."""
        completion = output.outputs[0]
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        finish = completion.finish_reason if output.finished else None
        text = completion.text or ""
        matched = self._first_stop(text)
        if matched is not None:
            text, finish = text[:matched], "stop"
        elif finish is None:
            text = text[: len(text) - self._held_back(text)]
        new_text = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        new_ids = completion.token_ids[self.num_tokens :]
        logprobs = None
        if self.want_logprobs and completion.logprobs is not None:
            logprobs = self._logprobs(new_ids, completion.logprobs[self.num_tokens :])
        self.sent_text += new_text
        self.num_tokens = len(completion.token_ids)
        self.finish_reason = finish
        return ChoiceDelta(new_text, list(new_ids), logprobs, finish)

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string starts in ``text`` (None: no match). Text already
        sent never holds one, so the search starts where a match could still begin."""
        start = max(len(self.sent_text) - max((len(s) for s in self.stop), default=0), 0)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """How many trailing characters of ``text`` must wait for more tokens."""
        held = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:  # the longest tail that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return held

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _logprobs(self, ids: list[int], tops: list[dict[int, float]]) -> dict[str, list[Any]]:
        tokens = [self._token_text(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [top[t] for t, top in zip(ids, tops, strict=True)],
            "top_logprobs": [{self._token_text(k): v for k, v in top.items()} for top in tops],
            "text_offset": offsets,
        }
