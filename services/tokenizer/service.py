"""`TokenizerHandler`: the tokenizer service's logic, without I/O.

    requests topic   GenerateRequest -> EngineRequest (tokenized topic)
                     AbortRequest    -> FinishRequest(abort) (tokenized topic)
    generated topic  GeneratedTokens -> TokenEvent (tokens topic): text deltas, stop strings;
                     a matched stop string also sends FinishRequest(stop) to the scheduler
                     SchedulerAnnouncement of a new scheduler -> error events for open streams

Idempotent under redelivery: a request id is tokenized once, and token messages whose index is
behind the stream's are dropped. A request that cannot be served gets one TokenEvent with
finish_reason "error".
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from parkade.schemas import (
    AbortRequest,
    EngineRequest,
    FinishReason,
    FinishRequest,
    GeneratedTokens,
    GenerateRequest,
    SchedulerAnnouncement,
    TokenEvent,
    Usage,
    topics,
)
from parkade.services.bus.base import Headers, Outgoing
from parkade.services.tokenizer.detokenizer import IncrementalDetokenizer

_REMEMBER_FINISHED = 100_000  # finished request ids kept to drop redelivered duplicates


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer
    headers: Headers
    num_prompt_tokens: int
    next_index: int = 0
    num_chars_sent: int = 0


def error_event(request_id: str, message: str, headers: Headers = ()) -> Outgoing:
    event = TokenEvent(request_id=request_id, index=0, finish_reason=FinishReason.ERROR, error=message)
    return Outgoing(topics.TOKENS, event, request_id, headers)


class TokenizerHandler:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(tokenizer)
        self.streams: dict[str, _Stream] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self.scheduler_id: str | None = None

    def on_request(self, message: GenerateRequest | AbortRequest, headers: Headers = ()) -> list[Outgoing]:
        request_id = message.request_id
        if isinstance(message, AbortRequest):
            if request_id not in self.streams:
                return []  # unknown or finished: aborting is idempotent
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            return [Outgoing(topics.TOKENIZED, finish, request_id, headers)]
        if request_id in self.streams or request_id in self._finished:
            return []  # a redelivered request
        try:
            token_ids = self._tokenize(message)
        except Exception as error:  # a bad prompt or chat template fails this request only
            self._remember_finished(request_id)
            return [error_event(request_id, str(error), headers)]
        params = message.sampling_params
        self.streams[request_id] = _Stream(
            IncrementalDetokenizer.for_request(self.tokenizer, token_ids, params), headers, len(token_ids)
        )
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=tuple(token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            priority=message.priority,
        )
        return [Outgoing(topics.TOKENIZED, request, request_id, headers)]

    def _tokenize(self, message: GenerateRequest) -> list[int]:
        if message.prompt_token_ids is not None:
            token_ids = list(message.prompt_token_ids)
        elif message.messages is not None:
            chat = [msgspec.structs.asdict(m) for m in message.messages]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            token_ids = self.tokenizer.encode(message.prompt)
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        if not 0 <= min(token_ids) <= max(token_ids) < self.vocab_size:
            raise ValueError(
                f"prompt_token_ids must be in [0, {self.vocab_size}) (the tokenizer's vocabulary)"
            )
        return token_ids

    def on_generated(self, message: GeneratedTokens | SchedulerAnnouncement) -> list[Outgoing]:
        if isinstance(message, SchedulerAnnouncement):
            return self.on_scheduler_announcement(message)
        return self.on_tokens(message)

    def on_scheduler_announcement(self, message: SchedulerAnnouncement) -> list[Outgoing]:
        """A new scheduler knows none of the running requests: end their streams."""
        previous, self.scheduler_id = self.scheduler_id, message.scheduler_id
        if previous is None or previous == message.scheduler_id:
            return []
        out = []
        for request_id, stream in list(self.streams.items()):
            self._close(request_id)
            out.append(
                error_event(request_id, "the scheduler restarted and lost this request", stream.headers)
            )
        return out

    def on_tokens(self, message: GeneratedTokens) -> list[Outgoing]:
        request_id = message.request_id
        stream = self.streams.get(request_id)
        if stream is None:
            if request_id in self._finished or message.finish_reason is not None:
                return []  # finished already
            # Tokens of a request this tokenizer never saw (it restarted): the text cannot be
            # rebuilt, so end the client's stream with an error and stop the scheduler.
            self._remember_finished(request_id)
            reason = "the tokenizer lost this request's state (restarted)"
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            return [error_event(request_id, reason), Outgoing(topics.TOKENIZED, finish, request_id)]
        if message.index < stream.next_index and message.token_ids:
            return []  # a redelivered message
        if message.error is not None:
            self._close(request_id)
            return [error_event(request_id, message.error, stream.headers)]
        out: list[Outgoing] = []
        finish_reason, stop_reason = message.finish_reason, message.stop_reason
        matched = stream.detokenizer.add_tokens(message.token_ids)
        stream.next_index = message.index + len(message.token_ids)
        if matched is not None:
            if finish_reason is None:  # the scheduler still runs it: tell it to stop
                finish = FinishRequest(request_id=request_id, reason=FinishReason.STOP, stop_reason=matched)
                out.append(Outgoing(topics.TOKENIZED, finish, request_id, stream.headers))
            finish_reason, stop_reason = FinishReason.STOP, matched
        text = stream.detokenizer.text(finished=finish_reason is not None)
        delta, stream.num_chars_sent = text[stream.num_chars_sent :], len(text)
        usage = None
        if finish_reason is not None:
            self._close(request_id)
            usage = Usage(
                prompt_tokens=stream.num_prompt_tokens,
                completion_tokens=stream.next_index,
                cached_tokens=message.num_cached_tokens,
            )
        event = TokenEvent(
            request_id=request_id,
            index=message.index,
            token_ids=message.token_ids,
            text=delta,
            logprobs=message.logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            usage=usage,
        )
        out.append(Outgoing(topics.TOKENS, event, request_id, stream.headers))
        return out

    def _close(self, request_id: str) -> None:
        del self.streams[request_id]
        self._remember_finished(request_id)

    def _remember_finished(self, request_id: str) -> None:
        self._finished[request_id] = None
        if len(self._finished) > _REMEMBER_FINISHED:
            self._finished.popitem(last=False)
