"""The context rule: what a request may ask of a model's `max_model_len`, checked in one place
for every path (the gateway, the tokenizer service, the in-process engine), with vLLM's words.

    prompt tokens                    <= max_model_len      else "... However, your request has N
                                                                 input tokens ..."
    prompt tokens + max_tokens       <= max_model_len      else "'max_tokens' is too large: ..."
    (max_tokens unset: the rest of the context, never refused)

A prompt whose text alone proves it too long is refused before it is tokenized
(`TokenLowerBound`): a flood of megabyte prompts costs a `len()` each, not a tokenization.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from parkade.services.common import prompts
from parkade.services.common.prompts import ChatOptions, ChatType

# vLLM's words for it. A text prompt of no characters is refused even where the tokenizer adds a
# BOS token (it would be a prompt of BOS alone: the model writes from nothing).
EMPTY_PROMPT = "The prompt cannot be empty."


class ContextLengthError(ValueError):
    """A request that does not fit in the model's context. `param`: the field to change
    (`max_tokens` or `max_completion_tokens`), None for the prompt (the caller names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_context_length(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int | None,
    *,
    max_tokens_name: str = "max_tokens",
    at_least: bool = False,
) -> None:
    """ContextLengthError unless the prompt, and the prompt with `max_tokens` outputs, fit.
    `at_least`: `num_prompt_tokens` is a lower bound (`TokenLowerBound`), said so."""
    if max_model_len is None:
        return
    if num_prompt_tokens > max_model_len:
        count = f"at least {num_prompt_tokens}" if at_least else str(num_prompt_tokens)
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request "
            f"has {count} input tokens. Please reduce the length of the input messages."
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"'{max_tokens_name}' is too large: {max_tokens}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}).",
            max_tokens_name,
        )


def prompt_token_ids(
    tokenizer: Any | None,
    *,
    bound: TokenLowerBound | None,
    vocab_size: int,
    max_model_len: int | None,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: ChatType | None = None,
    chat: ChatOptions | None = None,
    truncate: int | None = None,
) -> list[int]:
    """`prompts.prompt_token_ids` under the context rule: an empty text is refused, a text that
    `bound` proves too long is refused untokenized (unless `truncate` cuts it), and a prompt of
    more than `max_model_len` tokens gets the rule's ContextLengthError. ValueError otherwise,
    as `prompts.prompt_token_ids`."""
    if prompt_token_ids is None and messages is None and prompt is not None:
        refuse_by_length(prompt, bound, max_model_len, truncate)
    token_ids = prompts.prompt_token_ids(
        tokenizer,
        vocab_size=vocab_size,
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        chat=chat,
        truncate=max_model_len if truncate == -1 else truncate,  # (-1 and no limit: none)
    )
    check_context_length(len(token_ids), None, max_model_len)
    return token_ids


def refuse_by_length(
    prompt: str, bound: TokenLowerBound | None, max_model_len: int | None, truncate: int | None = None
) -> None:
    """ValueError for an empty text prompt, ContextLengthError for one that `bound` proves too
    long (not when `truncate` cuts it): both without tokenizing it."""
    if prompt == "":
        raise ValueError(EMPTY_PROMPT)
    if bound is not None and truncate is None and max_model_len is not None:
        at_least = bound.min_tokens(prompt)
        if at_least > max_model_len:
            check_context_length(at_least, None, max_model_len, at_least=True)


# Normalizers that never make a text shorter (in characters); Replace only when its content is
# at least as long as its (plain string) pattern.
_GROWING_NORMALIZERS = {"Prepend", "Lowercase", "NFD", "NFKD"}
# Pre-tokenizers that only split (or map each byte to one character): every character stays.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


class TokenLowerBound:
    """A lower bound on how many tokens a text becomes, from its length alone.

    NOTE: why it holds. Say every token covers at most `max_token_chars` characters of the text
    as the model sees it (normalized), and the normalized text is at least as long as the text
    given. Then tokens * max_token_chars >= len(normalized) >= len(text), so
    tokens >= ceil(len(text) / max_token_chars); special tokens the post-processor adds (BOS)
    only add to the count. Each token covers:
      - a vocabulary piece: len(piece) characters (a continuing-subword prefix such as `##` is
        counted as if it were text: the bound only gets weaker);
      - a byte-fallback token `<0xAB>`: one byte, so at most one character;
      - an added (special) token matched in the text: len(content) characters.
    `from_tokenizer` builds a bound only where those premises are checked from the tokenizer's
    own description, and none otherwise (then every prompt is tokenized, as before):
      - the model is BPE, and every byte has a token (byte fallback with all 256 `<0x..>`
        pieces, or a ByteLevel pre-tokenizer whose 256 characters are all pieces): no text ever
        becomes `<unk>`, which with `fuse_unk` covers any number of characters;
      - the normalizers never shorten the text (`_GROWING_NORMALIZERS`; NFC and Strip can);
      - the pre-tokenizers drop no character (`_KEEPING_PRE_TOKENIZERS`; Whitespace drops the
        spaces, and so does a Split whose behavior is "removed");
      - no added token strips the whitespace around it (lstrip/rstrip: it then covers any run).
    """

    def __init__(self, max_token_chars: int) -> None:
        if max_token_chars < 1:
            raise ValueError("max_token_chars must be >= 1")
        self.max_token_chars = max_token_chars

    def min_tokens(self, text: str) -> int:
        return math.ceil(len(text) / self.max_token_chars)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenLowerBound | None:
        """The bound of a Hugging Face tokenizer (a fast one, or a `tokenizers.Tokenizer`);
        None where its premises do not hold (see the class)."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        try:
            spec = json.loads(backend.to_str())
        except (AttributeError, TypeError, ValueError):
            return None  # a slow (Python) tokenizer: nothing to read the rules from
        normalizer = getattr(backend, "normalizer", None)
        normalize = normalizer.normalize_str if normalizer is not None else str
        longest = _longest_token(spec, normalize)
        return None if longest is None else cls(longest)


def _longest_token(spec: dict[str, Any], normalize: Any = str) -> int | None:
    """The most characters one token covers, or None if the premises do not hold. NOTE: an
    added token that is `normalized` matches the normalized text, where it covers its normalized
    content (found by the property test: Prepend("▁") makes "abracadab" cover "▁abracadab")."""
    model, added = spec.get("model") or {}, spec.get("added_tokens") or []
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    pre = spec.get("pre_tokenizer")
    if not all(map(_normalizer_ok, _parts(spec.get("normalizer"), "normalizers"))):
        return None
    if not all(map(_pre_tokenizer_ok, _parts(pre, "pretokenizers"))):
        return None
    vocab: dict[str, int] = model["vocab"]
    byte_fallback = model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if not (byte_fallback or _byte_level_complete(pre, vocab)):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    lengths = [len(piece) for piece in vocab] + [
        len(normalize(t.get("content", "")) if t.get("normalized") else t.get("content", "")) for t in added
    ]
    return max(1, *lengths)


def _parts(component: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [p for c in component.get(key, []) for p in _parts(c, key)]
    return [component]


def _normalizer_ok(part: dict[str, Any]) -> bool:
    if part.get("type") == "Replace":
        pattern = (part.get("pattern") or {}).get("String")
        return pattern is not None and len(part.get("content", "")) >= len(pattern)
    return part.get("type") in _GROWING_NORMALIZERS


def _pre_tokenizer_ok(part: dict[str, Any]) -> bool:
    if part.get("behavior") == "Removed":  # Split and Punctuation may drop what they match
        return False
    return part.get("type") in _KEEPING_PRE_TOKENIZERS


def _byte_level_complete(pre: dict[str, Any] | None, vocab: dict[str, int]) -> bool:
    """A ByteLevel pre-tokenizer maps each byte to one of 256 characters: complete when each of
    them is a piece."""
    if not any(p.get("type") == "ByteLevel" for p in _parts(pre, "pretokenizers")):
        return False
    from tokenizers.pre_tokenizers import ByteLevel

    return all(c in vocab for c in ByteLevel.alphabet())
