"""A prompt's token ids, checked against its model, and the words a request bans as token ids:
the tokenization that the front end (the tokenizer service, the in-process engine) and the
gateway share. A request is tokenized once: the gateway sends what it tokenized as token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from parkade.schemas import ChatMessage, SamplingParams

ChatType = Sequence[ChatMessage | Mapping[str, str]]


# What `render_chat` passes to apply_chat_template itself.
_RENDER_ARGUMENTS = frozenset(
    {"conversation", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message"}
)


@dataclass(frozen=True, kw_only=True)
class ChatOptions:
    """How a chat is rendered into a prompt (vLLM's `LLM.chat` and OpenAI-server options):
    `chat_template` replaces the tokenizer's; `add_generation_prompt` opens the assistant's turn;
    `continue_final_message` leaves the last (assistant) message open, so that the model goes
    on writing it; `chat_template_kwargs` are more variables for the template."""

    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        taken = sorted(set(self.chat_template_kwargs or ()) & _RENDER_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: pass them as options")

    @classmethod
    def of(cls, request: Any) -> ChatOptions:
        """The options a `GenerateRequest` carries."""
        return cls(
            chat_template=request.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
        )


def prompt_token_ids(
    tokenizer: Any | None,
    *,
    vocab_size: int,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: ChatType | None = None,
    chat: ChatOptions | None = None,
    truncate: int | None = None,
) -> list[int]:
    """Token ids win over `messages` (rendered with the chat template, see `ChatOptions`), which
    win over `prompt` text. `truncate` keeps only the last k tokens, as vLLM's
    `truncate_prompt_tokens`. ValueError for a prompt that cannot run on this model: no tokens,
    ids outside its vocabulary. (Its length against the context: `context.prompt_token_ids`.)"""
    token_ids = _tokenize(tokenizer, prompt, prompt_token_ids, messages, chat or ChatOptions())
    if truncate is not None and len(token_ids) > truncate:
        token_ids = token_ids[-truncate:]
    if not token_ids:
        raise ValueError("the prompt has no tokens")
    if not 0 <= min(token_ids) <= max(token_ids) < vocab_size:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) (the model's vocab_size)")
    return token_ids


def _tokenize(
    tokenizer: Any | None,
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: ChatType | None,
    chat: ChatOptions,
) -> list[int]:
    if prompt_token_ids is not None:
        return [int(t) for t in prompt_token_ids]
    if tokenizer is None:
        raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids instead")
    if messages is not None:
        text = render_chat(tokenizer, messages, chat)
        # The template writes the special tokens (BOS) itself.
        return list(tokenizer.encode(text, add_special_tokens=False))
    if prompt is None:
        raise ValueError("no prompt: give prompt text, prompt_token_ids or messages")
    return list(tokenizer.encode(prompt))


def render_chat(tokenizer: Any, messages: ChatType, chat: ChatOptions) -> str:
    """A conversation as prompt text, by the tokenizer's chat template (or `chat.chat_template`)."""
    conversation = [m if isinstance(m, Mapping) else msgspec.structs.asdict(m) for m in messages]
    if chat.continue_final_message and (not conversation or conversation[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs a conversation that ends with an assistant message")
    return tokenizer.apply_chat_template(
        conversation,
        chat_template=chat.chat_template,
        tokenize=False,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        **(chat.chat_template_kwargs or {}),
    )


def resolve_bad_words(tokenizer: Any | None, params: SamplingParams) -> SamplingParams:
    """`params` with its `bad_words` moved into `bad_words_token_ids` (vLLM's rule: each word
    alone and after a space, since a word mid-text is usually tokenized with its leading space),
    so that resolving again tokenizes nothing."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; pass bad_words_token_ids instead")
    sequences = list(params.bad_words_token_ids)
    for word in params.bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in sequences:
                sequences.append(ids)
    return msgspec.structs.replace(params, bad_words=(), bad_words_token_ids=tuple(sequences))
