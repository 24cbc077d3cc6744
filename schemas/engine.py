"""Messages between the tokenizer and the scheduler: token ids in, token ids out.

The tokenizer sends `EngineRequest`s (already tokenized) and `FinishRequest`s (a stop string
matched, or the client aborted); the scheduler answers with `GeneratedTokens`.
"""

from __future__ import annotations

import enum

import msgspec

from parkade.schemas.sampling import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


class ErrorKind(enum.StrEnum):
    """Why a request ended with an error, for clients that answer with a status (the gateway)."""

    INVALID_REQUEST = "invalid_request"  # it cannot run as sent: a bad prompt, id or parameter
    OVERLOADED = "overloaded"  # refused by a queue bound; the same request may run later
    UNAVAILABLE = "unavailable"  # no executor, or a service lost its state: try again
    INTERNAL = "internal"  # a failure while it ran


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True, tag="engine_request"):
    """A tokenized generate request. `eos_token_ids` come from the model's generation config."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0
    arrival_time: float = 0.0
    cache_salt: str | None = None  # see GenerateRequest
    # Tokens this request already generated on another replica (a hand-over, see
    # RequestRouted): this replica recomputes prompt + these and goes on from there.
    output_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must be non-empty")
        if min(self.prompt_token_ids) < 0:
            raise ValueError("prompt_token_ids must be >= 0")


class FinishRequest(msgspec.Struct, frozen=True, kw_only=True, tag="finish_request"):
    """Finish a request early (a stop string matched, or an abort). Idempotent."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT
    stop_reason: str | None = None


class TokenLogprobs(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Logprobs at one position: entry 0 is the sampled token, then the top-k tokens.

    Logprobs are of the model's raw distribution (before temperature and penalties), as vLLM's
    default. `ranks[i]` is 1 for the most likely token.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]


class GeneratedTokens(msgspec.Struct, frozen=True, kw_only=True, tag="generated_tokens"):
    """New output tokens of one request. `index` is the position of `token_ids[0]` in the output.

    `finish_reason` is set on the request's last message; `stop_reason` names the stop token id
    that ended it, if any.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason "error": why the request was refused
    error_kind: ErrorKind | None = None  # with `error`
    # On a request's first event, when its params asked for them: the logprobs of prompt
    # tokens 1.. (entry 0 of each is the prompt token itself), as vLLM's `prompt_logprobs[1:]`.
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    replica: str = ""  # the replica that wrote it ("" inside a GeneratedBatch: the batch's)


class GeneratedBatch(msgspec.Struct, frozen=True, kw_only=True, tag="generated_batch"):
    """One step's events in one record on the generated topic.

    NOTE: one record per step, not per token: a Kafka record costs the producer, the broker and the
    consumer far more CPU than the few bytes of a token, and those processes share the machine
    with the executor. Each event is still handled on its own (deduplicated by `index`).
    """

    events: tuple[GeneratedTokens, ...]
    replica: str = ""  # the replica that wrote it


class SchedulerAnnouncement(msgspec.Struct, frozen=True, kw_only=True, tag="scheduler_announcement"):
    """Sent by a scheduler when it starts, on the generated topic. With `resumes`, it carries on
    the requests of the one before (it rebuilt them from the log); without, a new `scheduler_id`
    means they are gone, and the tokenizer ends their streams with an error."""

    scheduler_id: str
    resumes: bool = False
    replica: str = ""
