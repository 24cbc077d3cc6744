"""A prompt's token ids, checked against its model: what the tokenizer service and the gateway
both refuse before a request reaches the scheduler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from parkade.schemas import ChatMessage

ChatType = Sequence[ChatMessage | Mapping[str, str]]


def prompt_token_ids(
    tokenizer: Any | None,
    *,
    vocab_size: int,
    max_model_len: int | None,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: ChatType | None = None,
) -> list[int]:
    """Token ids win over `messages` (rendered with the tokenizer's chat template), which win
    over `prompt` text. ValueError for a prompt that cannot run on this model: no tokens, longer
    than `max_model_len` (the model's own limit), ids outside its vocabulary."""
    token_ids = _tokenize(tokenizer, prompt, prompt_token_ids, messages)
    if not token_ids:
        raise ValueError("the prompt has no tokens")
    if max_model_len is not None and len(token_ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, more than the model's max_model_len={max_model_len}"
        )
    if not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) (the model's vocab_size)")
    return token_ids


def _tokenize(
    tokenizer: Any | None,
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: ChatType | None,
) -> list[int]:
    if prompt_token_ids is not None:
        return [int(t) for t in prompt_token_ids]
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
    if messages is not None:
        chat = [m if isinstance(m, Mapping) else msgspec.structs.asdict(m) for m in messages]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        # The template writes the special tokens (BOS) itself.
        return list(tokenizer.encode(text, add_special_tokens=False))
    if prompt is None:
        raise ValueError("no prompt: give prompt text, prompt_token_ids or messages")
    return list(tokenizer.encode(prompt))
