"""A GGUF file's tokenizer (``tokenizer.ggml.*`` metadata) as an HF ``tokenizers.Tokenizer``.

The vocabulary, merges and token types become a byte-level BPE (``tokenizer.ggml.model =
"gpt2"``, what every DeepSeek-family file holds): control tokens special, user-defined ones
added whole, both at their own ids and in their own spelling. (``transformers``' GGUF builder
is not used: it drops control tokens outside the byte alphabet, i.e. DeepSeek's
``<｜end▁of▁sentence｜>``, and knows no DeepSeek pre-tokenizer.) ``PRE_TOKENIZER_SPLITS`` holds
the pre-tokenizers, copied from llama.cpp's ``llama-vocab.cpp`` (which defines how a GGUF file
tokenizes; for ``kimi-k2``, which llama.cpp hand-codes, the ``pat_str`` of Kimi's
``tokenization_kimi.py`` it implements: Oniguruma, behind ``tokenizers``, has its class
intersections): each regex splits the text in turn (``Isolated``), then bytes map to the
byte-level alphabet.

``tokenizer.ggml.add_bos_token`` true puts the bos token before every encoded text (a
``TemplateProcessing`` post-processor), as llama.cpp does; llama.cpp's default for these
pre-tokenizers is false.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlafx.config.gguf_file import GgufFile, open_gguf

_DEEPSEEK_LLM_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
    "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄ"
    "Ⰰ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "deepseek-llm": (  # DeepSeek-V2 / V2-Lite / Coder-V2
        "[\r\n]",
        f"\\s?[{_DEEPSEEK_LLM_LETTERS}]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    ),
    "deepseek-v3": (  # DeepSeek-V3 / R1
        "\\p{N}{1,3}",
        "[一-龥぀-ゟ゠-ヿ]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
        "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "kimi-k2": (  # Kimi K2 / K2.5: tokenization_kimi.py's pat_str (llama.cpp hand-codes it)
        "[\\p{Han}]+"
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
        "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
        "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
    "glm4": (  # GLM-4.7-Flash
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"
        "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    ),
}
_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type",
    "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens",
    "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type",
    "tokenizer.ggml.merges": "merges",
}


def pre_tokenizer(pre: str) -> Any:
    """The ``tokenizers`` pre-tokenizer of a DeepSeek-family ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, pre_tokenizers

    splits = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        for pattern in PRE_TOKENIZER_SPLITS[pre]
    ]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([*splits, byte_level])


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str]) -> Any:
    """llama.cpp's ``gpt2`` vocabulary as a ``tokenizers`` BPE: normal tokens are already in
    the byte-level alphabet; control (3) and user-defined (4) tokens are stored as their text
    (DeepSeek's ``<｜end▁of▁sentence｜>``) and matched whole, at their own ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [(left, right) for left, _, right in (m.partition(" ") for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=False))
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        AddedToken(token, special=kind == 3, normalized=False)
        for token, kind in zip(tokens, types, strict=False)
        if kind in (3, 4)
    ]
    tokenizer.add_tokens([t for t in added if not t.special])
    tokenizer.add_special_tokens([t for t in added if t.special])
    return tokenizer


def gguf_tokenizer(gguf: GgufFile) -> Any | None:
    """The file's tokenizer, or None when its metadata has none (token-id prompts only);
    ``ValueError`` for a tokenizer type or pre-tokenizer mlafx cannot rebuild."""
    from tokenizers import processors

    meta = gguf.metadata
    if "tokenizer.ggml.tokens" not in meta:
        return None
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF metadata tokenizer.ggml.model={kind!r}: mlafx rebuilds byte-level BPE "
            "('gpt2', every DeepSeek-family file) only"
        )
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"GGUF metadata tokenizer.ggml.pre={pre!r} is a pre-tokenizer mlafx does not "
            f"know; known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [])
    tokenizer.pre_tokenizer = pre_tokenizer(pre)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        token = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{token} $A", pair=f"{token} $A {token} $B", special_tokens=[(token, bos)]
        )
    return tokenizer


# the chat template's special tokens and the metadata keys of their ids
GGUF_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_chat_template(metadata: dict[str, Any]) -> tuple[str, dict[str, str]] | None:
    """The file's ``tokenizer.chat_template`` and the special tokens it renders (bos_token ->
    its text); None when it has no template."""
    source = metadata.get("tokenizer.chat_template")
    if not isinstance(source, str):
        return None
    vocabulary = metadata.get("tokenizer.ggml.tokens") or []
    tokens = {}
    for name, key in GGUF_SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        if isinstance(token_id, int) and 0 <= token_id < len(vocabulary):
            tokens[name] = vocabulary[token_id]
    return source, tokens


def save_gguf_tokenizer(path: str | Path, directory: Path) -> bool:
    """Write a GGUF file's tokenizer as a checkpoint directory holds it: ``tokenizer.json``,
    and with a chat template ``chat_template.jinja`` plus the special tokens it renders in
    ``tokenizer_config.json`` (what ``mlafx export`` ships beside the weights). False (nothing
    written) when the file has no tokenizer."""
    import json

    gguf = open_gguf(path)
    tokenizer = gguf_tokenizer(gguf)
    if tokenizer is None:
        return False
    tokenizer.save(str(directory / "tokenizer.json"))
    template = gguf_chat_template(gguf.metadata)
    if template is not None:
        source, tokens = template
        (directory / "chat_template.jinja").write_text(source)
        config = json.dumps(tokens, ensure_ascii=False, indent=1)
        (directory / "tokenizer_config.json").write_text(config)
    return True
