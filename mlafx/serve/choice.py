"""One choice of a (chat) completion, built up from the engine's cumulative outputs.

The engine reports each prompt's whole output so far (per copy: token ids, decoded text,
per-token logprobs) after every step that drew a token. ``ChoiceState.update`` turns copy
``copy`` of it into the part not sent yet, a ``ChoiceDelta``, applying the rules a client
sees:

- stop strings: the text ends just before the first match of any of them, and the choice
  finishes with ``finish_reason="stop"`` (the caller then aborts the engine copy);
  ``token_ids`` and logprobs still list every token generated, the matching one included;
- text not yet safe to send is held back: a tail that may be the start of a stop string,
  or that ends in U+FFFD (a multi-byte character whose remaining bytes come with the next
  token); a finished choice sends all it has;
- ``echo``: the first delta starts with the prompt's text and, with logprobs, its tokens
  (the first one's logprob is None);
- each token's text is its exact share of the text (``TokenTexts``), so ``text_offset``
  and ``tokens`` slice ``text``; without a tokenizer a token reads ``token_id:N``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlafx.runtime import RequestOutput


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a choice: its text, where that starts in the choice's text, its
    logprob (None: the first prompt token) and the top alternatives (text -> logprob)."""

    text: str
    offset: int
    logprob: float | None
    top: dict[str, float] | None


@dataclass
class ChoiceDelta:
    """What a choice gained since the last update."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None  # the engine failed this choice (finish_reason "error")

    def merge(self, later: ChoiceDelta) -> None:
        self.text += later.text
        self.token_ids += later.token_ids
        self.finish_reason = later.finish_reason
        self.error = later.error
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs


class TokenTexts:
    """Each token's share of the decoded text of a token sequence: token ``i`` is
    ``text[b_i:b_(i+1)]``, ``b_i`` being the length of the first ``i`` tokens' decoded
    text without a trailing incomplete character (U+FFFD); the last token of a finished
    sequence takes the rest."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.bound = 0

    def extend(self, ids: Sequence[int], final: bool) -> list[str]:
        texts = []
        for j, token in enumerate(ids):
            self.ids.append(token)
            text = self.tokenizer.decode(self.ids)
            end = len(text) if final and j == len(ids) - 1 else len(text.rstrip("\ufffd"))
            texts.append(text[self.bound : max(end, self.bound)])
            self.bound = max(end, self.bound)
        return texts


@dataclass
class ChoiceState:
    """The sent part of one choice: copy ``copy`` of its prompt's engine output.
    ``tokenizer`` is the model's (None: token ids only)."""

    stop: list[str]
    tokenizer: Any | None
    want_logprobs: bool
    copy: int = 0
    echo: bool = False
    sent_text: str = ""
    num_tokens: int = 0  # token ids (and logprob entries) already sent
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    _echoed: bool = False
    _prompt_text: str = ""
    _text_offset: int = 0
    _texts: TokenTexts | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: RequestOutput) -> ChoiceDelta:
        """The delta since the last update; call only while not ``finished``."""
        completion = output.outputs[self.copy]
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens
        prefix = self._echo(output) if self.echo and not self._echoed else None
        finish = completion.finish_reason if completion.finish_reason is not None else None
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
            logprobs = self._entries(
                new_ids, completion.logprobs[self.num_tokens :], final=finish is not None
            )
        self.sent_text += new_text
        self.num_tokens = len(completion.token_ids)
        self.finish_reason = finish
        delta = ChoiceDelta(new_text, list(new_ids), logprobs, finish, completion.error)
        if prefix is not None:
            prefix.merge(delta)
            prefix.token_ids = delta.token_ids  # generated ids only
            return prefix
        return delta

    def _echo(self, output: RequestOutput) -> ChoiceDelta:
        """The prompt, as the first delta of an ``echo`` choice."""
        self._echoed = True
        ids = output.prompt_token_ids
        if self.tokenizer is not None:
            self._prompt_text = self.tokenizer.decode(ids)
        logprobs = None
        if self.want_logprobs and output.prompt_logprobs is not None:
            texts = self._token_texts(ids, final=True)
            logprobs = []
            for i, (token, text) in enumerate(zip(ids, texts, strict=True)):
                top = output.prompt_logprobs[i]
                logprobs.append(
                    TokenLogprob(
                        text,
                        self._text_offset,
                        None if top is None else top[token],
                        None if top is None else self._tops(top),
                    )
                )
                self._text_offset += len(text)
        self._text_offset = len(self._prompt_text)
        self._texts = None  # the generated tokens start a new sequence
        return ChoiceDelta(self._prompt_text, [], logprobs)

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

    def _token_texts(self, ids: Sequence[int], *, final: bool) -> list[str]:
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        if self._texts is None:
            self._texts = TokenTexts(self.tokenizer)
        return self._texts.extend(ids, final)

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _tops(self, top: dict[int, float]) -> dict[str, float]:
        return {self._token_text(k): v for k, v in top.items()}

    def _entries(
        self, ids: list[int], tops: list[dict[int, float]], *, final: bool
    ) -> list[TokenLogprob]:
        entries = []
        for token, text, top in zip(ids, self._token_texts(ids, final=final), tops, strict=True):
            entries.append(TokenLogprob(text, self._text_offset, top[token], self._tops(top)))
            self._text_offset += len(text)
        return entries


def completion_logprobs(entries: list[TokenLogprob] | None) -> dict[str, list[Any]] | None:
    """OpenAI's completions layout: ``tokens``, ``token_logprobs``, ``top_logprobs`` and
    ``text_offset``, one entry per token."""
    if entries is None:
        return None
    return {
        "tokens": [e.text for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [e.top for e in entries],
        "text_offset": [e.offset for e in entries],
    }


def chat_logprobs(entries: list[TokenLogprob] | None, top_k: int) -> dict[str, Any] | None:
    """OpenAI's chat layout: ``{"content": [{token, logprob, bytes, top_logprobs}]}`` with
    the ``top_k`` most likely alternatives per token."""
    if entries is None:
        return None

    def item(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for e in entries:
        ranked = sorted((e.top or {}).items(), key=lambda kv: -kv[1])[:top_k]
        content.append({**item(e.text, e.logprob), "top_logprobs": [item(*kv) for kv in ranked]})
    return {"content": content}
