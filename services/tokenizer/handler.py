"""`TokenizerHandler`: the tokenizer service's logic, without I/O; the front end (`frontend.py`)
does the work, this maps it to and from the topics.

    requests topic   GenerateRequest -> EngineRequest (tokenized topic)
                     AbortRequest    -> FinishRequest(abort) (tokenized topic)
    generated topic  GeneratedBatch (a step's) / GeneratedTokens (one request's end)
                                     -> TokenEvent per event (tokens topic): text deltas, stop
                     strings; a matched stop string also sends FinishRequest(stop) to the scheduler
                     SchedulerAnnouncement of a new scheduler -> error events for open streams

Idempotent under redelivery: a request id is tokenized once, and token messages whose index is
behind the stream's are dropped. A request that cannot be served gets one TokenEvent with
finish_reason "error".
"""

from __future__ import annotations

from dataclasses import dataclass

from parkade.schemas import (
    AbortRequest,
    EngineRequest,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    GenerateRequest,
    SchedulerAnnouncement,
    TokenEvent,
    topics,
)
from parkade.services.bus.base import Headers, Outgoing
from parkade.services.bus.serve import rejected_letter
from parkade.services.common.recent import RecentIds
from parkade.services.tokenizer.frontend import FrontEnd, RequestStream, StreamUpdate

# Where a request record came from (topic, partition, offset): the same record read again is a
# redelivery; another record with the same request id is a second request.
Source = tuple[str, int, int]


@dataclass
class _Open:
    stream: RequestStream
    headers: Headers  # the request's trace context, passed on with every record about it
    source: Source | None = None


def error_event(request_id: str, message: str, headers: Headers = (), index: int = 0) -> Outgoing:
    event = TokenEvent(request_id=request_id, index=index, finish_reason=FinishReason.ERROR, error=message)
    return Outgoing(topics.TOKENS, event, request_id, headers)


def token_event(request_id: str, update: StreamUpdate) -> TokenEvent:
    return TokenEvent(
        request_id=request_id,
        index=update.index,
        token_ids=update.token_ids,
        text=update.text_delta,
        logprobs=update.logprobs,
        finish_reason=update.finish_reason,
        stop_reason=update.stop_reason,
        usage=update.usage,
        error=update.error,
    )


class TokenizerHandler:
    def __init__(self, frontend: FrontEnd) -> None:
        self.frontend = frontend
        self.streams: dict[str, _Open] = {}
        self.finished = RecentIds()  # to drop redelivered requests and late messages
        self.scheduler_id: str | None = None

    def on_request(
        self, message: GenerateRequest | AbortRequest, headers: Headers = (), source: Source | None = None
    ) -> list[Outgoing]:
        """`source`: where the record came from, to tell a redelivery (the same record: nothing to
        do) from a second request with an id in use (answered with an error event; the error
        event carries the second request's headers, by which its client tells it apart)."""
        request_id = message.request_id
        if isinstance(message, AbortRequest):
            if request_id not in self.streams:
                return []  # unknown or finished: aborting is idempotent
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            return [Outgoing(topics.TOKENIZED, finish, request_id, headers)]
        open_ = self.streams.get(request_id)
        if open_ is not None:
            if source is None or open_.source == source:
                return []  # a redelivered request
            error = f"request id {request_id!r} is in use by a live request"
            return [error_event(request_id, error, headers)]
        if request_id in self.finished:
            if source is None or self.finished.get(request_id) == source:
                return []  # a redelivered request
            error = f"request id {request_id!r} was used by a request that ended recently; use a fresh id"
            return [error_event(request_id, error, headers)]
        try:
            request, stream = self.frontend.make_request_from(message)
        except Exception as error:  # a bad prompt or chat template fails this request only
            self.finished.add(request_id, source)
            return [error_event(request_id, str(error), headers)]
        self.streams[request_id] = _Open(stream, headers, source)
        return [Outgoing(topics.TOKENIZED, request, request_id, headers)]

    def on_generated(
        self, message: GeneratedBatch | GeneratedTokens | SchedulerAnnouncement
    ) -> list[Outgoing]:
        if isinstance(message, SchedulerAnnouncement):
            return self.on_scheduler_announcement(message)
        if isinstance(message, GeneratedBatch):
            out: list[Outgoing] = []
            for event in message.events:
                out += self._tokens_or_error(event)
            return out
        return self.on_tokens(message)

    def _tokens_or_error(self, event: GeneratedTokens) -> list[Outgoing]:
        """One event of a step's batch: a failure ends that request only (error event, and the
        scheduler stops it), never the other requests of the step."""
        try:
            return self.on_tokens(event)
        except Exception as error:
            open_ = self.streams.get(event.request_id)
            headers, index = (open_.headers, open_.stream.next_index) if open_ else ((), event.index)
            if open_ is not None:
                self._close(event.request_id)
            self.finished.add(event.request_id)
            finish = FinishRequest(request_id=event.request_id, reason=FinishReason.ABORT)
            return [
                error_event(event.request_id, f"the tokenizer failed on its tokens: {error}", headers, index),
                Outgoing(topics.TOKENIZED, finish, event.request_id, headers),
            ]

    def on_scheduler_announcement(self, message: SchedulerAnnouncement) -> list[Outgoing]:
        """A new scheduler knows none of the running requests: end their streams."""
        previous, self.scheduler_id = self.scheduler_id, message.scheduler_id
        if previous is None or previous == message.scheduler_id:
            return []
        out = []
        for request_id, open_ in list(self.streams.items()):
            self._close(request_id)
            out.append(
                error_event(
                    request_id,
                    "the scheduler restarted and lost this request",
                    open_.headers,
                    open_.stream.next_index,
                )
            )
        return out

    def on_tokens(self, message: GeneratedTokens) -> list[Outgoing]:
        request_id = message.request_id
        open_ = self.streams.get(request_id)
        if open_ is None:
            if request_id in self.finished or message.finish_reason is not None:
                return []  # finished already
            # Tokens of a request this tokenizer never saw (it restarted): the text cannot be
            # rebuilt, so end the client's stream with an error and stop the scheduler.
            self.finished.add(request_id)
            reason = "the tokenizer lost this request's state (restarted)"
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            return [error_event(request_id, reason), Outgoing(topics.TOKENIZED, finish, request_id)]
        update = open_.stream.update(message)
        if update is None:
            return []  # a redelivered message
        out: list[Outgoing] = []
        if update.stop_scheduler:
            finish = FinishRequest(
                request_id=request_id, reason=FinishReason.STOP, stop_reason=str(update.stop_reason)
            )
            out.append(Outgoing(topics.TOKENIZED, finish, request_id, open_.headers))
        if update.finish_reason is not None:
            self._close(request_id)
        out.append(Outgoing(topics.TOKENS, token_event(request_id, update), request_id, open_.headers))
        return out

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused a record this handler produced (too large): the client hears why,
        and a request that cannot go on is stopped."""
        message = out.message
        request_id = getattr(message, "request_id", None)
        if not isinstance(message, EngineRequest | TokenEvent) or request_id is None:
            return [rejected_letter(out, error)]
        open_ = self.streams.get(request_id)
        if isinstance(message, EngineRequest):
            if open_ is not None:
                self._close(request_id)
            return [error_event(request_id, f"the request could not be forwarded: {error}", out.headers)]
        if message.error is not None and open_ is None:
            return []  # an error event refused: the stream is closed, nothing smaller to say
        out_: list[Outgoing] = []
        if open_ is not None:  # the stream cannot go on without this event
            self._close(request_id)
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            out_.append(Outgoing(topics.TOKENIZED, finish, request_id, out.headers))
        reason = f"an event of this request could not be sent: {error}"
        return [*out_, error_event(request_id, reason, out.headers, message.index)]

    def _close(self, request_id: str) -> None:
        open_ = self.streams.pop(request_id)
        self.finished.add(request_id, open_.source)
