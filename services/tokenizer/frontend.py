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

import msgspec

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
    sample_request_id,
)
from parkade.services.common import context, prompts
from parkade.services.common.model_config import ModelConfig, resolve_max_model_len
from parkade.services.common.model_files import (
    MAX_MODEL_LEN_METADATA,
    MODEL_METADATA,
    check_model_folder,
    load_tokenizer,
)
from parkade.services.common.prompts import ChatOptions, ChatType
from parkade.services.common.simulation import SIMULATE_METADATA, max_positions
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
    max_model_len: int | None = field(default=None, metadata=MAX_MODEL_LEN_METADATA)
    # Only its model's length limit is read here: the tokens are the model folder's.
    simulate: str | None = field(default=None, metadata=SIMULATE_METADATA)
    trust_request_chat_template: bool = field(
        default=False,
        metadata={
            "help": "let requests from the topics (and the gateway's) carry their own chat_template: a "
            "template is code that runs, and one that loops or allocates without end takes the service "
            "down (vLLM's --trust-request-chat-template); LLM.chat's chat_template is the script's own"
        },
    )


# The most prompt logprob entries (positions x (1 + top k)) a request on the topics may ask for:
# they travel in one record (the first token's event), and Kafka's default record limit is 1 MiB;
# an entry is about 18 bytes in msgpack and 30 in JSON.
MAX_WIRE_PROMPT_LOGPROB_ENTRIES = 20_000


def prompt_fields(prompt: PromptType) -> dict[str, Any]:
    """vLLM's prompt forms as `FrontEnd.make_request` keywords (a dict may carry `cache_salt`)."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    salt = {"cache_salt": prompt["cache_salt"]} if prompt.get("cache_salt") is not None else {}
    if "prompt_token_ids" in prompt:
        return {"prompt": prompt.get("prompt"), "prompt_token_ids": prompt["prompt_token_ids"], **salt}
    if "prompt" in prompt:
        return {"prompt": prompt["prompt"], **salt}
    raise ValueError("a prompt is text, {'prompt': text} or {'prompt_token_ids': [...]}")


@dataclass(frozen=True)
class StreamUpdate:
    """What one `GeneratedTokens` changes for the client: one sample's news."""

    index: int  # output position of token_ids[0]
    token_ids: tuple[int, ...]
    text: str  # all the text of this sample shown so far
    text_delta: str  # what this update adds to `text`
    logprobs: tuple[TokenLogprobs, ...] | None = None
    finish_reason: FinishReason | None = None  # this sample's
    stop_reason: int | str | None = None
    stop_scheduler: bool = False  # a stop string matched: the scheduler must finish the sample
    usage: Usage | None = None  # on the request's last update (its last sample's)
    error: str | None = None  # with finish_reason "error": it ends every sample
    error_kind: ErrorKind | None = None  # with `error`
    sample_index: int = 0
    engine_request_id: str = ""  # the sample's id at the scheduler
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # once, on sample 0's first update
    # Samples the scheduler still runs that must be finished: the request failed.
    cancel: tuple[str, ...] = ()


@dataclass(eq=False)
class _Sample:
    """One sample of a request as the client sees it."""

    index: int
    engine_request_id: str
    detokenizer: IncrementalDetokenizer | None
    next_index: int = 0
    text: str = ""
    finished: bool = False
    token_ids: list[int] = field(default_factory=list)  # its outputs so far (for a hand-over)


class RequestStream:
    """One request as the client sees it: for each of its samples the detokenizer, the next
    output index and the text shown.

    Idempotent: a message whose tokens start behind its sample's next index (a redelivery)
    changes nothing. Once every sample finished (or the request failed), it takes no more.
    """

    def __init__(
        self,
        request_id: str,
        requests: Sequence[EngineRequest],
        prompt: str | None,
        detokenizers: Sequence[IncrementalDetokenizer | None],
    ) -> None:
        self.request_id = request_id
        self.engine_requests = tuple(requests)  # one per sample, in sample order
        self.request = self.engine_requests[0]
        self.prompt = prompt
        self.samples = [
            _Sample(i, r.request_id, d) for i, (r, d) in enumerate(zip(requests, detokenizers, strict=True))
        ]
        self._by_engine_id = {s.engine_request_id: s for s in self.samples}
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.finished = False

    @property
    def engine_request_ids(self) -> tuple[str, ...]:
        return tuple(s.engine_request_id for s in self.samples)

    @property
    def next_index(self) -> int:
        """Sample 0's next output index (where an error event of the request says it ended)."""
        return self.samples[0].next_index

    @property
    def num_output_tokens(self) -> int:
        return sum(s.next_index for s in self.samples)

    def output_token_ids(self, engine_request_id: str) -> tuple[int, ...]:
        """A sample's output tokens so far."""
        return tuple(self._by_engine_id[engine_request_id].token_ids)

    def next_index_of(self, engine_request_id: str) -> int:
        return self._by_engine_id[engine_request_id].next_index

    def live_engine_request_ids(self) -> tuple[str, ...]:
        return tuple(s.engine_request_id for s in self.samples if not s.finished)

    def hole_before(self, message: GeneratedTokens) -> int | None:
        """The index the sample's next tokens should start at, where `message`'s start past it:
        events between were lost (never legitimate: every hop delivers a sample's events in
        order and a hand-over resumes at the next index). None: no hole."""
        sample = self._by_engine_id.get(message.request_id)
        if sample is None or sample.finished or not message.token_ids or message.index <= sample.next_index:
            return None
        return sample.next_index

    def update(self, message: GeneratedTokens) -> StreamUpdate | None:
        """Apply the scheduler's next message about one sample; None when it changes nothing (a
        redelivery, or news of a request that ended)."""
        sample = self._by_engine_id.get(message.request_id)
        if (
            sample is None
            or self.finished
            or sample.finished
            or (message.token_ids and message.index < sample.next_index)
        ):
            return None
        if sample.index == 0:
            self.num_cached_tokens = message.num_cached_tokens
        if message.error is not None:
            return self._failed(sample, message)
        if message.token_ids and self.first_token_time is None:
            self.first_token_time = time.time()
        finish_reason, stop_reason = message.finish_reason, message.stop_reason
        stop_scheduler = False
        text = sample.text
        if sample.detokenizer is not None:
            matched = sample.detokenizer.add_tokens(message.token_ids)
            if matched is not None:
                stop_scheduler = finish_reason is None  # the scheduler still runs it
                finish_reason, stop_reason = FinishReason.STOP, matched
            # A streamed text never shows what a stop string may still cut.
            text = sample.detokenizer.text(finished=finish_reason is not None)
        delta, sample.text = text[len(sample.text) :], text
        sample.next_index = message.index + len(message.token_ids)
        sample.token_ids.extend(message.token_ids)
        usage = self._finish(sample) if finish_reason is not None else None
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
            sample_index=sample.index,
            engine_request_id=sample.engine_request_id,
            prompt_logprobs=message.prompt_logprobs,
        )

    def _failed(self, sample: _Sample, message: GeneratedTokens) -> StreamUpdate:
        """An error event ends the whole request: every sample still running is to be cancelled."""
        sample.finished = self.finished = True
        return StreamUpdate(
            sample.next_index,
            (),
            sample.text,
            "",
            finish_reason=FinishReason.ERROR,
            error=message.error,
            error_kind=message.error_kind or ErrorKind.INTERNAL,
            sample_index=sample.index,
            engine_request_id=sample.engine_request_id,
            cancel=self.live_engine_request_ids(),
        )

    def _finish(self, sample: _Sample) -> Usage | None:
        """A sample finished; -> the request's usage when it was the last one."""
        sample.finished = True
        if not all(s.finished for s in self.samples):
            return None
        self.finished = True
        return Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.num_output_tokens,
            cached_tokens=self.num_cached_tokens,
        )


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s own params: one sample each; a seed moved on by the index, so that
    seeded samples differ from each other and each is reproducible (vLLM's rule); prompt
    logprobs computed by sample 0 only, so that the others share its prompt blocks (a request
    that wants prompt logprobs bypasses the prefix cache)."""
    if params.n == 1:
        return params
    seed = params.seed
    if seed is not None:
        seed = (seed + index + 2**63) % 2**64 - 2**63  # wraps within the 64-bit range
    return msgspec.structs.replace(
        params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None
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
        trust_request_chat_template: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        # The limit set (`resolve_max_model_len`). An executor may serve less, which the scheduler
        # refuses; a prompt over this could never run anywhere, and an absurdly long one must not
        # travel further (a record over the broker's size limit).
        self.max_model_len = max_model_len
        # Refuses a text that cannot fit before it is tokenized (None: this tokenizer's rules
        # give no bound, and every text is tokenized).
        self.token_bound = None if tokenizer is None else context.TokenLowerBound.from_tokenizer(tokenizer)
        self.trust_request_chat_template = trust_request_chat_template
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
            max_model_len=resolve_max_model_len(
                max_positions(options.model, options.simulate), options.max_model_len
            ),
            trust_request_chat_template=options.trust_request_chat_template,
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
        cache_salt: str | None = None,
        chat: ChatOptions | None = None,
    ) -> tuple[EngineRequest, RequestStream]:
        """Tokenize and check one request. `prompt_token_ids` win over `messages` (rendered with
        the chat template, as `chat` says), which win over `prompt` text; with token ids, `prompt`
        is only kept for the output. Raises ValueError for a request that cannot run on this model:
        ContextLengthError for a prompt, or a prompt with `max_tokens` outputs, over max_model_len
        (`context.check_context_length`; max_tokens=None asks for the rest of the context).

        -> (sample 0's EngineRequest, the stream); with n > 1 samples, `stream.engine_requests`
        holds one EngineRequest per sample (ids from `sample_request_id`), sent to the scheduler
        one after the other so that the later ones find sample 0's prompt blocks cached."""
        params = sampling_params or SamplingParams()
        token_ids = self.prompt_token_ids(
            prompt, prompt_token_ids, messages, chat=chat, truncate=params.truncate_prompt_tokens
        )
        context.check_context_length(len(token_ids), params.max_tokens, self.max_model_len)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        params = prompts.resolve_bad_words(self.tokenizer, params)
        params.vocab_checks(self.vocab_size)
        arrival_time = self._arrival_time()
        requests = [
            EngineRequest(
                request_id=sample_request_id(request_id, i, params.n),
                prompt_token_ids=tuple(token_ids),
                sampling_params=sample_params(params, i),
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                arrival_time=arrival_time,
                cache_salt=cache_salt,
            )
            for i in range(params.n)
        ]
        detokenizers = [
            IncrementalDetokenizer.for_request(self.tokenizer, token_ids, params)
            if self.tokenizer is not None and params.detokenize
            else None
            for _ in requests
        ]
        stream = RequestStream(request_id, requests, prompt, detokenizers)
        return requests[0], stream

    def make_request_from(
        self, message: GenerateRequest, token_ids: Sequence[int] | None = None
    ) -> tuple[EngineRequest, RequestStream]:
        """`make_request` for a request from the requests topic, with the checks of what a client
        may not ask across Kafka (ValueError naming it). `token_ids`: its text prompt's, already
        tokenized (`prompt_token_ids` of it, truncated as it asks)."""
        if message.chat_template is not None and not self.trust_request_chat_template:
            raise ValueError(
                "chat_template in a request is refused: this tokenizer uses the model's own (start it "
                "with --trust-request-chat-template to allow requests' templates)"
            )
        request, stream = self.make_request(
            message.request_id,
            prompt=message.prompt,
            prompt_token_ids=message.prompt_token_ids if token_ids is None else token_ids,
            messages=message.messages,
            sampling_params=message.sampling_params,
            priority=message.priority,
            cache_salt=message.cache_salt,
            chat=ChatOptions.of(message),
        )
        params = message.sampling_params
        if params.prompt_logprobs is not None:
            entries = (len(request.prompt_token_ids) - 1) * (params.prompt_logprobs + 1)
            if entries > MAX_WIRE_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(
                    f"prompt_logprobs={params.prompt_logprobs} over a {len(request.prompt_token_ids)}-token "
                    f"prompt is {entries} entries, more than one Kafka record carries "
                    f"({MAX_WIRE_PROMPT_LOGPROB_ENTRIES}): ask for fewer, or use the Python API"
                )
        return request, stream

    def prompt_token_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        messages: ChatType | None = None,
        *,
        chat: ChatOptions | None = None,
        truncate: int | None = None,
    ) -> list[int]:
        """The prompt's token ids, checked against the model (see `context.prompt_token_ids`)."""
        return context.prompt_token_ids(
            self.tokenizer,
            bound=self.token_bound,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            messages=messages,
            chat=chat,
            truncate=truncate,
        )

    def refuse_by_length(self, prompt: str, truncate: int | None = None) -> None:
        """What `prompt_token_ids` refuses of a text prompt before tokenizing it (see
        `context.refuse_by_length`)."""
        context.refuse_by_length(prompt, self.token_bound, self.max_model_len, truncate)

    def _arrival_time(self) -> float:
        """Wall-clock seconds, strictly increasing per front end, so that the priority policy's
        tie-break (arrival) follows the order requests reached the front end even within one
        clock tick. Wall clock rather than monotonic: the time travels to another process."""
        now = max(time.time(), self._last_arrival + 1e-6)
        self._last_arrival = now
        return now
