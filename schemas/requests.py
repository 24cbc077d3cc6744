"""Messages on the requests topic (client -> tokenizer), keyed by `request_id`."""

from __future__ import annotations

from typing import Any

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
    # Requests with different salts never share prefix-cache blocks (vLLM's `cache_salt`): a
    # tenant's salt keeps others from learning its prompts by the timing of cache hits.
    cache_salt: str | None = None
    # How `messages` are rendered (vLLM's chat options): a Jinja template in place of the
    # tokenizer's, the assistant turn opened, or the last (assistant) message continued.
    chat_template: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # The `session` router keeps the requests of one session on one replica (and every router
    # counts it as a hint of a shared prefix); OpenAI's `user` field under the gateway.
    session_id: str | None = None

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
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string or unset")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")


def sample_request_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of a request with `n` samples: the request's own id
    when n == 1, so that a single-sample request keeps its id end to end."""
    return request_id if n == 1 else f"{request_id}#{index}"


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Stop a request; aborting an unknown or finished request is a no-op (idempotent)."""

    request_id: str


class TokenizerAnnouncement(msgspec.Struct, frozen=True, kw_only=True, tag="tokenizer_announcement"):
    """Sent by a tokenizer when it starts, on the requests topic it reads: once it reads its own,
    it has read again every request from before its start (see the tokenizer's handler)."""

    tokenizer_id: str
