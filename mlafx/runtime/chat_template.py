"""A model's chat template: the Jinja program that turns a list of messages into the prompt
text the model was trained on, rendered the way ``transformers``' ``apply_chat_template``
renders it (a sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks`` and loop
controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text,
and the tokenizer's special tokens as ``bos_token``, ``eos_token``, ...).

Where it comes from: a checkpoint directory's ``chat_template.jinja``, else the
``chat_template`` of its ``tokenizer_config.json`` (a string, or a list of named templates:
the one named ``default``); a GGUF file's ``tokenizer.chat_template``. The special tokens
come from ``tokenizer_config.json`` (a string or an ``AddedToken`` dict) or the GGUF's
``tokenizer.ggml.*_token_id``.

The rendered text already holds the special tokens it needs, so it is encoded without the
tokenizer's own additions (``encode(text, add_special_tokens=False)``, as ``transformers``
does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlafx.config.gguf_tokenizer import gguf_chat_template

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or failed)."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> its text

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text of ``messages`` (``{"role", "content", ...}`` dicts);
        ``variables`` are extra template variables (e.g. ``enable_thinking``)."""
        try:
            return _compile(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(
                f"the chat template cannot render these messages: {e}"
            ) from None


def load_chat_template(model: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory or GGUF file; None when it has none."""
    if str(model).endswith(".gguf"):
        from mlafx.config.gguf_file import open_gguf

        return _gguf_template(open_gguf(model).metadata)
    directory = Path(model)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    jinja_path = directory / "chat_template.jinja"
    source = jinja_path.read_text() if jinja_path.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return ChatTemplate(source, tokens)


def _gguf_template(metadata: dict[str, Any]) -> ChatTemplate | None:
    template = gguf_chat_template(metadata)
    return None if template is None else ChatTemplate(*template)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template is not valid Jinja: {e}") from None
