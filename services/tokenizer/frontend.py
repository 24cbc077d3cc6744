"""The front end: everything between a client's request and an `EngineRequest`, and between the
scheduler's `GeneratedTokens` and what the client is shown. No bus I/O: `FrontEnd.from_options`
reads the model folder once, and the rest is computation. The in-process engine
(`parkade.engine`) and the tokenizer service (`handler.py`) both call it, so the two paths cannot
drift apart.

    text | token ids | chat messages
        --FrontEnd.make_request-->  EngineRequest (tokenized, checked, arrival_time set)
                                    + RequestStream (what the client has been shown)
    GeneratedTokens
        --RequestStream.update-->   StreamUpdate: new token ids, the text they add (held back
                                    while it could still become a stop string), finish, usage

A stop string that matches while the scheduler still runs the request sets
`StreamUpdate.stop_scheduler`: the caller tells the scheduler to finish it (in-process, a call;
across Kafka, a `FinishRequest`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parkade.models import DEFAULT_MODEL
from parkade.schemas import (
    EngineRequest,
    ErrorKind,
    FinishReason,
    GeneratedTokens,
    GenerateRequest,
    SamplingParams,
    TokenLogprobs,
    Usage,
)
from parkade.services.common import prompts
from parkade.services.common.model_config import ModelConfig
from parkade.services.common.model_files import MODEL_METADATA, check_model_folder, load_tokenizer
from parkade.services.common.prompts import ChatType
from parkade.services.tokenizer.detokenizer import IncrementalDetokenizer

# A prompt as vLLM's offline API takes it: text, {"prompt": text}, or {"prompt_token_ids": [...]}
# (optionally with "prompt", kept for the output).
PromptType = str | Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class TokenizerOptions:
    """What the front end reads: the model folder (vocabulary size, EOS ids) and its tokenizer."""

    model: str | Path = field(default=DEFAULT_MODEL, metadata=MODEL_METADATA)
    tokenizer: str | Path | None = field(
        default=None, metadata={"help": "folder of the tokenizer (tokenizer.json); unset: the model's"}
    )


def prompt_fields(prompt: PromptType) -> dict[str, Any]:
    """vLLM's prompt forms as `FrontEnd.make_request` keywords."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if "prompt_token_ids" in prompt:
        return {"prompt": prompt.get("prompt"), "prompt_token_ids": prompt["prompt_token_ids"]}
    if "prompt" in prompt:
        return {"prompt": prompt["prompt"]}
    raise ValueError("a prompt is text, {'prompt': text} or {'prompt_token_ids': [...]}")


@dataclass(frozen=True)
class StreamUpdate:
    """What one `GeneratedTokens` changes for the client."""

    index: int  # output position of token_ids[0]
    token_ids: tuple[int, ...]
    text: str  # all the text shown so far
    text_delta: str  # what this update adds to `text`
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    stop_scheduler: bool = False  # a stop string matched: the scheduler must finish the request
    usage: Usage | None = None  # on the last update
    error: str | None = None  # with finish_reason "error"
    error_kind: ErrorKind | None = None  # with `error`


class RequestStream:
    """One request as the client sees it: the detokenizer, the next output index, the text shown.

    Idempotent: a message whose tokens start behind the next index (a redelivery) changes nothing.
    Once finished, it takes no more messages.
    """

    def __init__(
        self, request: EngineRequest, prompt: str | None, detokenizer: IncrementalDetokenizer | None
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.detokenizer = detokenizer
        self.next_index = 0
        self.text = ""
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.finished = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def update(self, message: GeneratedTokens) -> StreamUpdate | None:
        """Apply the scheduler's next message; None when it changes nothing (a redelivery)."""
        if self.finished or (message.token_ids and message.index < self.next_index):
            return None
        self.num_cached_tokens = message.num_cached_tokens
        if message.error is not None:
            self.finished = True
            return StreamUpdate(
                self.next_index,
                (),
                self.text,
                "",
                finish_reason=FinishReason.ERROR,
                error=message.error,
                error_kind=message.error_kind or ErrorKind.INTERNAL,
            )
        if message.token_ids and self.first_token_time is None:
            self.first_token_time = time.time()
        finish_reason, stop_reason = message.finish_reason, message.stop_reason
        stop_scheduler = False
        text = self.text
        if self.detokenizer is not None:
            matched = self.detokenizer.add_tokens(message.token_ids)
            if matched is not None:
                stop_scheduler = finish_reason is None  # the scheduler still runs it
                finish_reason, stop_reason = FinishReason.STOP, matched
            # A streamed text never shows what a stop string may still cut.
            text = self.detokenizer.text(finished=finish_reason is not None)
        delta, self.text = text[len(self.text) :], text
        self.next_index = message.index + len(message.token_ids)
        usage = None
        if finish_reason is not None:
            self.finished = True
            usage = Usage(
                prompt_tokens=len(self.request.prompt_token_ids),
                completion_tokens=self.next_index,
                cached_tokens=message.num_cached_tokens,
            )
        return StreamUpdate(
            message.index,
            message.token_ids,
            text,
            delta,
            logprobs=message.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            stop_scheduler=stop_scheduler,
            usage=usage,
        )


class FrontEnd:
    """Turns prompts into `EngineRequest`s for one model; opens a `RequestStream` for each."""

    def __init__(
        self,
        tokenizer: Any | None,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # The model's own limit (its max_position_embeddings). An executor may serve less, which
        # the scheduler refuses; a prompt over this could never run anywhere, and an absurdly
        # long one must not travel further (a record over the broker's size limit).
        self.max_model_len = max_model_len
        self._last_arrival = 0.0

    @classmethod
    def from_options(cls, options: TokenizerOptions, *, skip_tokenizer_init: bool = False) -> FrontEnd:
        """The front end of a model folder: its config's vocab_size and EOS ids, its tokenizer
        (none with `skip_tokenizer_init`: prompts are then token ids, outputs have no text)."""
        check_model_folder(options.model, weights=False, tokenizer=False)  # load_tokenizer checks its own
        config = ModelConfig.from_pretrained(options.model)
        tokenizer = None if skip_tokenizer_init else load_tokenizer(options.tokenizer or options.model)
        return cls(
            tokenizer,
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids,
            max_model_len=config.max_position_embeddings,
        )

    def make_request(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatType | None = None,
        sampling_params: SamplingParams | None = None,
        priority: int = 0,
    ) -> tuple[EngineRequest, RequestStream]:
        """Tokenize and check one request. `prompt_token_ids` win over `messages` (rendered with
        the tokenizer's chat template), which win over `prompt` text; with token ids, `prompt` is
        only kept for the output. Raises ValueError for a request that cannot run on this model."""
        params = sampling_params or SamplingParams()
        token_ids = self.prompt_token_ids(prompt, prompt_token_ids, messages)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            arrival_time=self._arrival_time(),
        )
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer.for_request(self.tokenizer, token_ids, params)
        return request, RequestStream(request, prompt, detokenizer)

    def make_request_from(self, message: GenerateRequest) -> tuple[EngineRequest, RequestStream]:
        """`make_request` for a request from the requests topic."""
        return self.make_request(
            message.request_id,
            prompt=message.prompt,
            prompt_token_ids=message.prompt_token_ids,
            messages=message.messages,
            sampling_params=message.sampling_params,
            priority=message.priority,
        )

    def prompt_token_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatType | None = None,
    ) -> list[int]:
        """The prompt's token ids, checked against the model (see `prompts.prompt_token_ids`)."""
        return prompts.prompt_token_ids(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
        )

    def _arrival_time(self) -> float:
        """Wall-clock seconds, strictly increasing per front end, so that the priority policy's
        tie-break (arrival) follows the order requests reached the front end even within one
        clock tick. Wall clock rather than monotonic: the time travels to another process."""
        now = max(time.time(), self._last_arrival + 1e-6)
        self._last_arrival = now
        return now
