"""Messages on the tokens topic (tokenizer -> clients), keyed by `request_id`; on a reply topic
whose requests asked for batches, `TokenEventBatch` records keyed by the topic's name."""

from __future__ import annotations

import msgspec

from parkade.schemas.engine import ErrorKind, FinishReason, TokenLogprobs


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts of a finished request; an object with named fields on the wire (once per
    request, so its field names cost nothing that matters)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True, tag="token_event"):
    """New output of one request: `token_ids` start at output position `index`; `text` is the
    new text (held back while it could still become a stop string).

    A request with n > 1 samples streams each sample's events, told apart by `sample_index`
    (0 .. n - 1), each with its own `index`. A sample's last event has `finish_reason`; the
    request's last event (its last sample's) also has `usage`, for all samples. A failed request
    gets one event with finish_reason "error", `error` (why) and `error_kind` (what a client may
    do about it): it ends every sample.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    sample_index: int = 0
    # On the first event of sample 0 when asked for: see GeneratedTokens.prompt_logprobs.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # With `error`: the request's field to change, when one is to blame ("max_tokens" for a
    # prompt + max_tokens over the model's max_model_len); the gateway answers with it as `param`.
    error_param: str | None = None


class TokenEventBatch(msgspec.Struct, frozen=True, kw_only=True, tag="token_event_batch"):
    """Token events of several requests in one record: only on a client's reply topic, and only
    for requests whose headers asked for it (`topics.REPLY_BATCHES`). One record per step (or per
    few steps) for a client with many streams open, where one per event would cost the tokenizer,
    the broker and the client a record each.

    `traceparents[i]` is the `traceparent` header `events[i]` would carry as a record of its own
    ("" for none): a client tells the requests that reuse an id apart by it. A request's events
    keep their order within a batch and across the batches (all on one partition)."""

    events: tuple[TokenEvent, ...]
    traceparents: tuple[str, ...]
