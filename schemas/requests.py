"""Messages on the requests topic (client -> tokenizer), keyed by `request_id`."""

from __future__ import annotations

import msgspec

from parkade.schemas.sampling import SamplingParams


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True, tag="generate"):
    """Generate a completion. Exactly one of `prompt` and `prompt_token_ids` is set.

    Lower `priority` values are served first under the priority scheduling policy (vLLM's rule).
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling_params: SamplingParams = SamplingParams()
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("exactly one of prompt and prompt_token_ids must be set")
        if self.prompt_token_ids is not None and not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")


class AbortRequest(msgspec.Struct, frozen=True, kw_only=True, tag="abort"):
    """Stop a request; aborting an unknown or finished request is a no-op (idempotent)."""

    request_id: str


RequestsMessage = GenerateRequest | AbortRequest
