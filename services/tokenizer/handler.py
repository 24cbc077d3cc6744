"""`TokenizerHandler`: the tokenizer service's logic, without I/O; the front end (`frontend.py`)
does the work, this maps it to and from the topics.

    requests topic   GenerateRequest -> EngineRequest (the tokenized topic of the replica the
                                        router picks), after a RequestRouted (the journal)
                     AbortRequest    -> FinishRequest(abort) (its replica's tokenized topic)
                     RequestRouted   a predecessor's routes, read again after a restart
    kv-events topic  ReplicaStatus / KVEvents -> the router's view of the replicas (router.py)
    generated topic  GeneratedBatch (a step's) / GeneratedTokens (one request's end)
                                     -> TokenEvent per event (tokens topic): text deltas, stop
                     strings; a matched stop string also sends FinishRequest(stop) to the scheduler
                     SchedulerAnnouncement: a restarted scheduler resumes the open streams
                     (`resumes`); one that does not ends them with error events

Replicas (the README's "Engine replicas and routing"): each sample runs on one replica at a time
(`routes.py`), and only that replica's events count; the samples of a replica that is gone are
handed over to another with the tokens they have (`check_replicas`). With several tokenizers,
each handles the request ids of its shard (`shard_of`) and reads past the others'.

Idempotent under redelivery: a request id is tokenized once, and token messages whose index is
behind the stream's are dropped; one whose index is ahead of it (events lost on the way: never
legitimate, see `KafkaConsumer`) ends the request with an error event rather than a stream short
of tokens. A request that cannot be served gets one TokenEvent with finish_reason "error".

A restart loses nothing (see the README's "What is durable where"): the group's commits never
pass the request record of the oldest open stream (`low_watermarks`), nor the generated topic
below its first event, so a restarted tokenizer reads every open stream's request and events
again, rebuilds the stream (detokenizer offsets, stop-string hold-back, usage) and sends its
events again: the client drops the indices it has (at-least-once), and gets the final event
even if the crash came before it went out. Events read before their request (the two topics are
read side by side) wait for it as orphans. A tokenizer announces itself on the requests topic at
start: once it reads its own announcement, every request from before its start has been read
again, and an orphan still without its request `orphan_wait_s` later (the generated topic may be
read further behind) belongs to a request that ended before the restart (it is forgotten), or
whose stream cannot be rebuilt (error event, and the scheduler stops it).
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parkade.schemas import (
    AbortRequest,
    EngineRequest,
    ErrorKind,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    GenerateRequest,
    RequestOutputKind,
    SchedulerAnnouncement,
    TokenEvent,
    TokenizerAnnouncement,
    sample_request_id,
    topics,
)
from parkade.schemas.routing import DEFAULT_REPLICA, KVEvents, ReplicaStatus, RequestRouted
from parkade.services.bus import replies
from parkade.services.bus.base import Headers, Outgoing, Record
from parkade.services.bus.serve import STREAM_FETCH_WAIT_MS, Service, dead_letter, rejected_letter
from parkade.services.common import tracing
from parkade.services.common.recent import RecentIds
from parkade.services.tokenizer.frontend import FrontEnd, RequestStream, StreamUpdate
from parkade.services.tokenizer.metrics import TokenizerMetrics
from parkade.services.tokenizer.replicas import REPLICA_WAIT_S, ReplicaRouting
from parkade.services.tokenizer.router import Router

# The messages of the generated topic.
Generated = GeneratedBatch | GeneratedTokens | SchedulerAnnouncement
Requests = GenerateRequest | AbortRequest | TokenizerAnnouncement | RequestRouted

# Where a request record came from (topic, partition, offset): the same record read again is a
# redelivery; another record with the same request id is a second request.
Source = tuple[str, int, int]


# How long events wait for their request once the requests from before the start are read.
ORPHAN_WAIT_S = 30.0

log = logging.getLogger(__name__)


@dataclass
class _Open:
    stream: RequestStream
    headers: Headers  # the request's trace context, passed on with every record about it
    source: Source | None = None
    # An offset of the generated topic at or below the stream's first event (None: below the
    # next record read).
    generated_start: int | None = None
    span: Any = None  # its detokenize span, while tracing is on
    session_id: str | None = None  # for the router
    # While the tokenizer reads its predecessor's log again (not caught up): the events read for
    # it, applied once its routes are known. None: applied as they come.
    deferred: list[tuple[GeneratedTokens, str | None]] | None = None


@dataclass
class _Orphan:
    """Events of a request not (yet) read again after a restart."""

    since: float  # when its first event was read
    generated_start: int | None
    events: list[tuple[GeneratedTokens, str | None]] = field(default_factory=list)  # with their replica


def shard_of(request_id: str, shards: int) -> int:
    """Which of `shards` tokenizers handles a request: by the id before its first `#`, so that a
    request's samples (`id#i`) and their events go to the tokenizer of the request."""
    return zlib.crc32(request_id.split("#", 1)[0].encode()) % shards


def tokens_out(event: TokenEvent, headers: Headers) -> Outgoing:
    """A token event, to the request's reply topic if it named one, else the shared one."""
    to = topics.reply_topic(headers)
    return Outgoing(topics.TOKENS, event, replies.reply_key(event.request_id, to, headers), headers, to)


def error_event(
    request_id: str,
    message: str,
    kind: ErrorKind,
    headers: Headers = (),
    index: int = 0,
    param: str | None = None,
) -> Outgoing:
    event = TokenEvent(
        request_id=request_id,
        index=index,
        finish_reason=FinishReason.ERROR,
        error=message,
        error_kind=kind,
        error_param=param,
    )
    return tokens_out(event, headers)


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
        error_kind=update.error_kind,
        sample_index=update.sample_index,
        prompt_logprobs=update.prompt_logprobs,
    )


class TokenizerHandler(ReplicaRouting, Service):
    group_id = "parkade-tokenizer"
    busy_fetch_wait_ms = STREAM_FETCH_WAIT_MS  # off the step loop
    consumes = (topics.REQUESTS, topics.GENERATED, topics.KV_EVENTS)

    def __init__(
        self,
        frontend: FrontEnd,
        *,
        orphan_wait_s: float = ORPHAN_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
        router: Router | None = None,
        replica_wait_s: float = REPLICA_WAIT_S,
        shard: int = 0,
        shards: int = 1,
    ) -> None:
        self.frontend = frontend
        # Several tokenizers share the topics by request id: this one handles the requests (and
        # their events) whose `shard_of` is `shard`, and reads past the others'. Its own group
        # and instance claim; shard 0 keeps the plain ones.
        if not 0 <= shard < shards:
            raise ValueError(f"tokenizer shard {shard} of {shards}: 0 <= shard < shards")
        self.shard, self.shards = shard, shards
        if shard:
            self.group_id = f"{TokenizerHandler.group_id}.{shard}"
            self.instance_name = f"tokenizer.{shard}"
        self.init_routing(router, replica_wait_s, clock)
        self.streams: dict[str, _Open] = {}  # by the client's request id
        # The live samples' ids at the scheduler -> their request's id. A request with n == 1
        # has one sample under its own id; n > 1 samples get ids of their own
        # (`sample_request_id`), and the scheduler's events name those.
        self.engine_ids: dict[str, str] = {}
        self.finished = RecentIds()  # to drop redelivered requests and late messages
        self.scheduler_id: str | None = None
        self.orphans: dict[str, _Orphan] = {}
        self.orphan_wait_s = orphan_wait_s
        self.clock = clock
        self.generated_position: int | None = None  # the offset after the last generated record
        self.tokenizer_id = uuid.uuid4().hex
        # When this tokenizer read its own announcement (None: not yet; without one, from 0).
        self.caught_up_at: float | None = 0.0
        self.metrics: TokenizerMetrics | None = None  # see enable_metrics

    def busy(self) -> bool:
        return bool(self.streams)  # tokens are owed to clients

    def enable_metrics(self) -> TokenizerMetrics:
        """Measure from now on (the service serves them with --metrics-port)."""
        self.metrics = TokenizerMetrics()
        self.metrics.watch_router(self.router)
        return self.metrics

    def announcement(self) -> Outgoing:
        """Sent once at start, on the requests topic (see the module)."""
        self.caught_up_at = None
        self.started_at = self.clock()
        return Outgoing(topics.REQUESTS, TokenizerAnnouncement(tokenizer_id=self.tokenizer_id))

    def on_record(
        self, message: Requests | Generated | ReplicaStatus | KVEvents, record: Record
    ) -> list[Outgoing]:
        if isinstance(message, ReplicaStatus | KVEvents):
            return self.on_replica(message, record.offset)
        if isinstance(message, GenerateRequest | AbortRequest | TokenizerAnnouncement | RequestRouted):
            return self.on_request(message, record.headers, (record.topic, record.partition, record.offset))
        return self.on_generated(message, record.offset)

    def mine(self, request_id: str) -> bool:
        """Whether this tokenizer handles the request (or sample) `request_id`."""
        return self.shards == 1 or shard_of(request_id, self.shards) == self.shard

    def on_bad_record(self, record: Record, error: Exception) -> list[Outgoing]:
        """A record that cannot be decoded goes to the dead-letter topic; a request record's
        stream, when its request id can be read (from the record, else its key), also gets an
        error event, so that a client with a typo gets an answer instead of waiting. (With
        several tokenizers: the one whose request it is; without an id, shard 0.)"""
        out = [dead_letter(record, error)]
        if not record.topic.endswith(topics.REQUESTS):
            return out if self.shard == 0 else []
        try:
            codec = msgspec.json if topics.is_json(record.header(topics.CONTENT_TYPE)) else msgspec.msgpack
            raw = codec.decode(record.value)
        except msgspec.DecodeError:
            raw = None
        request_id = raw.get("request_id") if isinstance(raw, dict) else None
        if not (isinstance(request_id, str) and request_id) and record.key:
            request_id = record.key.decode(errors="replace")
        if isinstance(request_id, str) and request_id:
            if not self.mine(request_id):
                return []
            error_text = f"invalid request: {error}"
            out.append(error_event(request_id, error_text, ErrorKind.INVALID_REQUEST, record.headers))
        elif self.shard != 0:
            return []
        return out

    def after_batch(self) -> list[Outgoing]:
        return self.check_orphans() + self.check_replicas()

    def coalesce(self, outgoing: list[Outgoing]) -> list[Outgoing]:
        # A step's events for one client in one record, where the client reads batches.
        return replies.batch_events(outgoing)

    def on_request(
        self,
        message: GenerateRequest | AbortRequest | TokenizerAnnouncement,
        headers: Headers = (),
        source: Source | None = None,
    ) -> list[Outgoing]:
        """`source`: where the record came from, to tell a redelivery (the same record: nothing to
        do) from a second request with an id in use (answered with an error event; the error
        event carries the second request's headers, by which its client tells it apart)."""
        if isinstance(message, TokenizerAnnouncement):
            if message.tokenizer_id == self.tokenizer_id and self.caught_up_at is None:
                self.caught_up_at = self.clock()
                log.info("read back its own announcement: every request from before its start is known")
                return self._resume_deferred()
            return []  # another's: an earlier tokenizer's, read again
        if not self.mine(message.request_id):
            return []  # another tokenizer's
        if isinstance(message, RequestRouted):
            if message.tokenizer_id != self.tokenizer_id:  # a predecessor's decision, read again
                request_id = self.engine_ids.get(message.request_id)
                if request_id is not None:
                    self.routes.add(message.request_id, request_id, message.replica, message.from_index)
            return []
        request_id = message.request_id
        if isinstance(message, AbortRequest):
            open_ = self.streams.get(request_id)
            if open_ is None:
                return []  # unknown or finished: aborting is idempotent
            return self._finish_samples(request_id, open_.stream.live_engine_request_ids(), headers)
        refused = self._refused_before_tokenizing(message, headers, source)
        if refused is not None:
            return refused
        return self._open(message, headers, source)

    def _refused_before_tokenizing(
        self, message: GenerateRequest, headers: Headers, source: Source | None
    ) -> list[Outgoing] | None:
        """Nothing (a redelivery), an error event (an id in use, a bad header or option), or None:
        the request may be tokenized."""
        request_id = message.request_id
        open_ = self.streams.get(request_id)
        if open_ is not None:
            if source is None or open_.source == source:
                return []  # a redelivered request
            error = f"request id {request_id!r} is in use by a live request"
            return [error_event(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        named = topics.header(headers, topics.REPLY_TOPIC)
        if named is not None and topics.reply_topic(headers) is None:
            error = f"invalid reply-topic header {named[:300]!r}"
            return [error_event(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        if request_id in self.finished:
            if source is None or self.finished.get(request_id) == source:
                return []  # a redelivered request
            error = f"request id {request_id!r} was used by a request that ended recently; use a fresh id"
            return [error_event(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        if message.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
            error = (
                "output_kind FINAL_ONLY is for the Python API: the tokens topic streams each sample's "
                "new tokens; keep the events until the one with finish_reason"
            )
            return [error_event(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        n = message.sampling_params.n
        taken = [
            e
            for e in (sample_request_id(request_id, i, n) for i in range(n))
            if e in self.engine_ids or (e != request_id and e in self.finished)
        ]
        if taken:
            # A sample id that names another live or recent request (a client chose "x#1"):
            # two requests would share the scheduler's record.
            error = f"request id {request_id!r}: its sample id {taken[0]!r} is in use; use another id"
            self.finished.add(request_id, source)
            return [error_event(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        return None

    def open_tokenized(
        self,
        message: GenerateRequest,
        headers: Headers,
        source: Source | None,
        token_ids: list[int] | BaseException,
        *,
        generated_start: int | None = None,
    ) -> list[Outgoing]:
        """`on_request` for a request whose prompt was tokenized aside (main.py): `token_ids`, or
        why they could not be had; `generated_start`: the generated topic's position when its
        record was read (its stream holds the commit from there)."""
        refused = self._refused_before_tokenizing(message, headers, source)
        if refused is not None:
            return refused
        out = self._open(message, headers, source, token_ids)
        open_ = self.streams.get(message.request_id)
        if open_ is not None and generated_start is not None:
            starts = [x for x in (open_.generated_start, generated_start) if x is not None]
            open_.generated_start = min(starts)
        return out

    def _open(
        self,
        message: GenerateRequest,
        headers: Headers,
        source: Source | None,
        token_ids: list[int] | BaseException | None = None,
    ) -> list[Outgoing]:
        """Tokenize a request (unless `token_ids` has its prompt's) and open its stream; -> its
        samples for the scheduler, after its events so far when they were read first (after a
        restart)."""
        request_id = message.request_id
        span = tracing.start_span("tokenize", headers, attributes={"parkade.request_id": request_id})
        try:
            if isinstance(token_ids, BaseException):
                raise token_ids  # tokenizing it aside failed: refused as here
            request, stream = self.frontend.make_request_from(message, token_ids)
        except Exception as error:  # a bad prompt or chat template fails this request only
            span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, str(error)))
            span.end()
            self.finished.add(request_id, source)
            param = getattr(error, "param", None)  # a ContextLengthError names max_tokens
            return [error_event(request_id, str(error), ErrorKind.INVALID_REQUEST, headers, param=param)]
        span.set_attribute("parkade.prompt_tokens", len(request.prompt_token_ids))
        span.end()
        if tracing.enabled() and not tracing.carries_context(headers):
            # A request from a client that traces nothing (kcat, plain Kafka), or whose context is
            # malformed: its trace starts here, and every record about it carries it on.
            own = (tracing.traceparent_of(span) or "").encode()
            headers = (*(h for h in headers if h[0] != "traceparent"), ("traceparent", own))
        if self.metrics is not None:
            self.metrics.requests.inc()
        open_ = self.streams[request_id] = _Open(stream, headers, source, self.generated_position)
        open_.session_id = message.session_id
        for engine_id in stream.engine_request_ids:
            self.engine_ids[engine_id] = request_id
        orphans = [o for e in stream.engine_request_ids if (o := self.orphans.pop(e, None)) is not None]
        if orphans:
            starts = [x for o in orphans for x in (o.generated_start, open_.generated_start) if x is not None]
            open_.generated_start = min(starts, default=None)
        if self.caught_up_at is None:
            # Read again after a restart: its routes may follow in the journal; it waits until
            # this tokenizer has read everything from before its start (`_resume_deferred`).
            open_.deferred = [event for o in orphans for event in o.events]
            return []
        out: list[Outgoing] = []
        for orphan in orphans:
            for event, replica in orphan.events:
                out += self._tokens_or_error(event, replica)
        if request_id in self.streams:
            out += self._send_samples(open_)
        return out

    def _resume_deferred(self) -> list[Outgoing]:
        """Caught up after a restart: every stream read again gets its events so far (those of
        its routes' replicas; the client drops what it has), and each live sample goes again to
        the replica that has it (which drops what it knows), or is routed now."""
        out: list[Outgoing] = []
        for request_id, open_ in list(self.streams.items()):
            events, open_.deferred = open_.deferred, None
            for event, replica in events or ():
                out += self._tokens_or_error(event, replica)
            if request_id in self.streams:
                out += self._send_samples(open_)
        return out

    def _end_request(self, request_id: str, error: str, kind: ErrorKind) -> list[Outgoing]:
        """End a request with an error event; its samples that run somewhere are aborted."""
        open_ = self.streams[request_id]
        samples = [e for e in open_.stream.live_engine_request_ids() if e not in self.routes.unrouted]
        self._close(request_id)
        return [
            error_event(request_id, error, kind, open_.headers, open_.stream.next_index),
            *self._finish_samples(request_id, samples, open_.headers),
        ]

    def low_watermarks(self) -> dict[str, int]:
        """What a restart must read again (see the module): the open streams' request records,
        and the generated topic from below their first events."""
        out = {}
        # NOTE: a gateway's own requests (in its memory, see topics.gateway_requests) die with
        # the process: nothing of theirs is read again, nor holds the requests topic's commit.
        sources = [
            o.source[2]
            for o in self.streams.values()
            if o.source is not None and not topics.is_gateway_requests(o.source[0])
        ]
        if sources:
            out[topics.REQUESTS] = min(sources)
        starts = [
            start
            for start in (
                *(o.generated_start for o in self.streams.values()),
                *(o.generated_start for o in self.orphans.values()),
            )
            if start is not None
        ]
        if starts:
            out[topics.GENERATED] = min(starts)
        if self.kv_low:
            out[topics.KV_EVENTS] = min(self.kv_low.values())
        return out

    def check_orphans(self) -> list[Outgoing]:
        """After every poll: orphans whose request did not come within `orphan_wait_s`. One that
        ended is forgotten; one still running cannot be rebuilt, so its client gets an error
        event and the scheduler stops it."""
        if not self.orphans or self.caught_up_at is None:
            return []  # their requests may still be read again
        now, out = self.clock(), []
        for request_id, orphan in list(self.orphans.items()):
            if now < max(orphan.since, self.caught_up_at) + self.orphan_wait_s:
                continue
            del self.orphans[request_id]
            self.finished.add(request_id)  # a request with this id from now on is a new one
            if any(e.finish_reason is not None for e, _ in orphan.events):
                continue
            reason = "the tokenizer lost this request's state (restarted)"
            finish = FinishRequest(request_id=request_id, reason=FinishReason.ABORT)
            index = orphan.events[0][0].index if orphan.events else 0
            replica = (orphan.events[-1][1] if orphan.events else None) or DEFAULT_REPLICA
            out.append(error_event(request_id, reason, ErrorKind.UNAVAILABLE, index=index))
            out.append(self._to_replica(replica, finish, request_id, ()))
        return out

    def on_generated(self, message: Generated, offset: int | None = None) -> list[Outgoing]:
        """`offset`: the record's, on the generated topic (None: not from the log)."""
        if offset is not None:
            if self.generated_position is None:
                # Streams opened before the first generated record: their events are at or after it.
                for open_ in self.streams.values():
                    if open_.generated_start is None:
                        open_.generated_start = offset
            self.generated_position = offset + 1
        if isinstance(message, SchedulerAnnouncement):
            return self.on_scheduler_announcement(message)
        if isinstance(message, GeneratedBatch):
            out: list[Outgoing] = []
            replica = message.replica or DEFAULT_REPLICA
            for event in message.events:
                out += self._tokens_or_error(event, replica)
            return out
        return self.on_tokens(message, message.replica or DEFAULT_REPLICA)

    def _tokens_or_error(self, event: GeneratedTokens, replica: str | None = None) -> list[Outgoing]:
        """One event of a step's batch: a failure ends that request only (error event, and the
        scheduler stops it), never the other requests of the step."""
        try:
            return self.on_tokens(event, replica)
        except Exception as error:
            request_id = self.engine_ids.get(event.request_id, event.request_id)
            open_ = self.streams.get(request_id)
            headers, index = (open_.headers, open_.stream.next_index) if open_ else ((), event.index)
            samples = open_.stream.live_engine_request_ids() if open_ else (event.request_id,)
            if open_ is not None:
                self._close(request_id)
            self.finished.add(request_id)
            self.finished.add(event.request_id)
            return [
                error_event(
                    request_id,
                    f"the tokenizer failed on its tokens: {error}",
                    ErrorKind.INTERNAL,
                    headers,
                    index,
                ),
                *self._finish_samples(request_id, samples, headers),
            ]

    def on_scheduler_announcement(self, message: SchedulerAnnouncement) -> list[Outgoing]:
        """A new scheduler that resumes its predecessor's requests: nothing to do. One that does
        not knows none of the running requests: end their streams."""
        previous, self.scheduler_id = self.scheduler_id, message.scheduler_id
        if previous is None or previous == message.scheduler_id or message.resumes:
            return []
        out = []
        for request_id, open_ in list(self.streams.items()):
            self._close(request_id)
            out.append(
                error_event(
                    request_id,
                    "the scheduler restarted and lost this request",
                    ErrorKind.UNAVAILABLE,
                    open_.headers,
                    open_.stream.next_index,
                )
            )
        return out

    def on_tokens(self, message: GeneratedTokens, replica: str | None = None) -> list[Outgoing]:
        """`replica`: the one that wrote the event (None: made here, for a sample no replica
        holds)."""
        engine_id = message.request_id
        request_id = self.engine_ids.get(engine_id)
        open_ = self.streams.get(request_id) if request_id is not None else None
        if open_ is None or request_id is None:
            if engine_id in self.finished or not self.mine(engine_id):
                return []  # finished already, or another tokenizer's
            # A request not read again yet after a restart: its events wait for it (see the
            # module), and a stream that never comes back is answered by `check_orphans`.
            orphan = self.orphans.get(engine_id)
            if orphan is None:
                start = None if self.generated_position is None else self.generated_position - 1
                orphan = self.orphans[engine_id] = _Orphan(self.clock(), start)
            orphan.events.append((message, replica))
            return []
        if open_.deferred is not None:
            open_.deferred.append((message, replica))
            return []
        if not self.routes.accepts(engine_id, replica, message.index):
            return []  # from a replica that no longer runs it (handed over)
        hole = open_.stream.hole_before(message)
        if hole is not None:
            # Shown as it came, the stream would silently lack tokens: the request fails instead.
            log.error(
                "request %s: events %d to %d never came (from replica %s); it ends with an error",
                engine_id, hole, message.index - 1, replica, extra={"request_id": request_id},
            )  # fmt: skip
            error = f"tokens {hole} to {message.index - 1} of this request were lost before the tokenizer"
            return self._end_request(request_id, error, ErrorKind.INTERNAL)
        route = self.routes.get(engine_id)
        if route is not None and not route.started and replica is not None:
            route.started = True
            self.router.first_token(route.replica, route.prompt_blocks, message.num_cached_tokens)
        update = open_.stream.update(message)
        if update is None:
            return []  # a redelivered message
        if open_.span is None and tracing.enabled():
            # The way back: from the first generated tokens to the request's last token event.
            attributes = {"parkade.request_id": request_id}
            open_.span = tracing.start_span("detokenize", open_.headers, attributes=attributes)
        out: list[Outgoing] = []
        if update.stop_scheduler:
            finish = FinishRequest(
                request_id=engine_id, reason=FinishReason.STOP, stop_reason=str(update.stop_reason)
            )
            out += self._finish_at_replica(engine_id, finish, request_id, open_.headers)
        elif update.finish_reason is not None and route is not None and route.replica != replica:
            # It ended on a replica it was handed over from (it finished before the hand-over
            # was read there): the one it was handed to stops too.
            finish = FinishRequest(request_id=engine_id, reason=FinishReason.ABORT)
            out += self._finish_at_replica(engine_id, finish, request_id, open_.headers)
        out += self._finish_samples(request_id, update.cancel, open_.headers)  # the request failed
        if open_.stream.finished:
            self._close(request_id)
        out.append(tokens_out(token_event(request_id, update), open_.headers))
        return out

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused a record this handler produced (too large): the client hears why,
        and a request that cannot go on is stopped."""
        message = out.message
        request_id = getattr(message, "request_id", None)
        if not isinstance(message, EngineRequest | TokenEvent) or request_id is None:
            return [rejected_letter(out, error)]
        if isinstance(message, EngineRequest):
            request_id = self.engine_ids.get(request_id, request_id)
            open_ = self.streams.get(request_id)
            if open_ is None:
                return []  # a request that failed already (another of its samples)
            samples = [e for e in open_.stream.live_engine_request_ids() if e != message.request_id]
            self._close(request_id)
            error_text = f"the request could not be forwarded: {error}"  # too large for the broker
            return [
                error_event(request_id, error_text, ErrorKind.INVALID_REQUEST, out.headers),
                *self._finish_samples(request_id, samples, out.headers),
            ]
        open_ = self.streams.get(request_id)
        if message.error is not None and open_ is None:
            return []  # an error event refused: the stream is closed, nothing smaller to say
        out_: list[Outgoing] = []
        if open_ is not None:  # the stream cannot go on without this event
            samples = open_.stream.live_engine_request_ids()
            self._close(request_id)
            out_ += self._finish_samples(request_id, samples, out.headers)
        reason = f"an event of this request could not be sent: {error}"
        return [*out_, error_event(request_id, reason, ErrorKind.INTERNAL, out.headers, message.index)]

    def _finish_samples(self, request_id: str, engine_ids: Sequence[str], headers: Headers) -> list[Outgoing]:
        """Abort these samples at their replicas (each answers with its final event; one that
        waits for a replica is answered here)."""
        out: list[Outgoing] = []
        for engine_id in engine_ids:
            finish = FinishRequest(request_id=engine_id, reason=FinishReason.ABORT)
            out += self._finish_at_replica(engine_id, finish, request_id, headers)
        return out

    def _close(self, request_id: str) -> None:
        open_ = self.streams.pop(request_id)
        if open_.span is not None:
            open_.span.set_attribute("parkade.output_tokens", open_.stream.num_output_tokens)
            open_.span.end()
        self.finished.add(request_id, open_.source)
        for engine_id in open_.stream.engine_request_ids:
            self.engine_ids.pop(engine_id, None)
            route = self.routes.forget(engine_id)
            if route is not None and route.segments:
                self.router.closed(route.replica, route.prompt_blocks, route.started)
            if engine_id != request_id:
                self.finished.add(engine_id, open_.source)
