"""Messages on the requests topic (client -> tokenizer), keyed by `request_id`."""

from __future__ import annotations

import msgspec

from parkade.schemas.sampling import SamplingParams


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    role: str  # "system" | "user" | "assistant" | ...
    content: str


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """Generate a completion. Exactly one of `prompt`, `prompt_token_ids` and `messages` (a chat,
    rendered by the model's chat template) is set.

    Lower `priority` values are served first under the priority scheduling policy (vLLM's rule).
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling_params: SamplingParams = SamplingParams()
    priority: int = 0
    messages: tuple[ChatMessage, ...] | None = None

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        given = [x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)]
        if sum(given) != 1:
            raise ValueError("exactly one of prompt, prompt_token_ids and messages must be set")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must be non-empty")


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Stop a request; aborting an unknown or finished request is a no-op (idempotent)."""

    request_id: str


class TokenizerAnnouncement(msgspec.Struct, frozen=True, kw_only=True, tag="tokenizer_announcement"):
    """Sent by a tokenizer when it starts, on the requests topic it reads: once it reads its own,
    it has read again every request from before its start (see the tokenizer's handler)."""

    tokenizer_id: str
