"""``mlafx chat``: talk to a model in the terminal. Each line typed is a user message; the
reply streams as it is generated, and the conversation so far (rendered with the model's
chat template, ``runtime/chat_template.py``) is the next prompt, so earlier turns come
from the prefix cache. ``/reset`` forgets the conversation, ``/exit`` (or end of input)
quits; a ``--system`` prompt opens every conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TextIO

from mlafx.runtime import LLM, SamplingParams


def reply(llm: LLM, messages: list[dict[str, str]], params: SamplingParams) -> Iterator[str]:
    """The assistant's next message, piece by piece as the engine generates it (text that
    ends in an incomplete character waits for the next token)."""
    if llm.tokenizer is None or llm.chat_template is None:
        raise ValueError("this model has no tokenizer or chat template, so it cannot chat")
    text = llm.chat_template.render(messages, add_generation_prompt=True)
    prompt = llm.tokenizer.encode(text, add_special_tokens=False).ids
    request_id = llm.add_request(prompt, params)
    sent = ""
    try:
        while llm.has_unfinished_requests():
            for output in llm.step():
                if output.request_id != request_id:
                    continue
                completion = output.outputs[0]
                if completion.finish_reason == "error":
                    raise RuntimeError(f"the engine failed this reply: {completion.error}")
                now = completion.text or ""
                if not output.finished:
                    now = now.rstrip("\ufffd")
                if len(now) > len(sent) and now.startswith(sent):
                    yield now[len(sent) :]
                    sent = now
    finally:
        llm.abort_request(request_id)  # a no-op once finished


def chat_loop(
    llm: LLM,
    params: SamplingParams,
    read: Callable[[str], str],
    out: TextIO,
    system: str | None = None,
) -> None:
    """Read user lines with ``read(prompt)`` (``input``) until ``/exit`` or EOF; write the
    replies to ``out``."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    while True:
        try:
            line = read(">>> ")
        except EOFError:
            out.write("\n")
            return
        line = line.strip()
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            messages = list(opening)
            out.write("(conversation reset)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        pieces = []
        for piece in reply(llm, messages, params):
            pieces.append(piece)
            out.write(piece)
            out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(pieces)})
