"""A client of the requests and tokens topics: submit generate requests, stream their events.

The library under `parkade.client.Client` (which finds the broker) and the HTTP gateway.

Each client has a reply topic of its own (`<prefix>tokens.<random>`, named in every request's
`reply-topic` header, with `reply-batches`: a step's events for it come in one record), so that
its reading cost follows its own traffic; it deletes the topic when it stops, keeps a heartbeat
for it while it runs, and as it starts reaps the reply topics of clients that died without
stopping (see replies.py); with `own_reply_topic=False` it reads the shared tokens topic instead
(every client sees every event and keeps those of its own requests), from its end before it
sends anything. An event whose trace context (`traceparent` header, or its entry in a batch) is
not its request's belongs to another request with the same id, and is not its stream's.

A stream never waits forever: it ends with `PipelineGoneError` when the broker stops answering
(probed whenever no record came for `PROBE_S`), or when no event of the request came for
`idle_timeout_s` (by then a live pipeline would have answered, if only with an error), and with
`TimeoutError` past its own `timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from parkade.schemas import (
    AbortRequest,
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    TokenEventBatch,
    topics,
)
from parkade.services.bus import replies
from parkade.services.bus.base import Bus, Outgoing, RecordRejected
from parkade.services.bus.serve import STREAM_FETCH_WAIT_MS, FetchWait, send_all
from parkade.services.common.prompts import ChatOptions

log = logging.getLogger(__name__)

# Seconds without a record after which the client asks the broker whether it is still there.
PROBE_S = 2.0
# After an abort, the seconds in which its last event may still come (see `stop`).
LATE_EVENTS_S = 5.0
# Seconds without an event of an open request after which its stream ends (and the request is
# cancelled): longer than the scheduler takes to declare an executor lost (15 s), to give up
# waiting for one (60 s) and to void a step without an answer (60 s). A request that waits longer
# than this in a deep queue ends the same way: pass a larger `idle_timeout_s` for such loads.
DEFAULT_IDLE_TIMEOUT_S = 90.0


def _chat_fields(chat: ChatOptions | None) -> dict[str, Any]:
    return dataclasses.asdict(chat) if chat is not None else {}


class PipelineGoneError(ConnectionError):
    """The broker stopped answering, or the pipeline stopped answering for a request."""


@dataclass
class _Stream:
    traceparent: bytes
    num_samples: int = 1
    queue: asyncio.Queue[TokenEvent | BaseException] = field(default_factory=asyncio.Queue)


def new_traceparent() -> bytes:
    """A W3C trace context for a new request (version 00, sampled)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01".encode()


class RequestClient:
    def __init__(
        self,
        bus: Bus,
        topic_prefix: str | None = None,
        *,
        bootstrap_servers: str | None = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        own_reply_topic: bool = True,
        reply_topic: str | None = None,
        requests_topic: str = topics.REQUESTS,
        heartbeat_s: float = replies.HEARTBEAT_S,
        reap_grace_s: float = replies.REAP_GRACE_S,
    ) -> None:
        """Talk to the pipeline over `bus` (`bootstrap_servers` only names it in errors).
        `reply_topic`: its name (default: a new one), where the caller needs it first; and
        `requests_topic` (unprefixed), where its requests and aborts go: a gateway with the
        tokenizer in its process keeps both in memory (see split.py). `heartbeat_s`,
        `reap_grace_s`: for the reply topic (see replies.py)."""
        self.bus = bus
        self.bootstrap_servers = bootstrap_servers
        self.prefix = topic_prefix or topics.DEFAULT_PREFIX
        self.requests_topic = requests_topic
        self.idle_timeout_s = idle_timeout_s
        self._streams: dict[str, _Stream] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closing = False
        self._decoder = topics.TopicDecoder(topics.TOKENS)
        if reply_topic is not None and not (
            own_reply_topic and replies.is_reply_topic(reply_topic, self.prefix)
        ):
            raise ValueError(f"{reply_topic!r} is not a reply topic of prefix {self.prefix!r}")
        self.reply_topic = (reply_topic or replies.new_reply_topic(self.prefix)) if own_reply_topic else None
        self.heartbeat_s = heartbeat_s
        self.reap_grace_s = reap_grace_s
        self._created = False  # whether this client created its reply topic (and must delete it)
        self._stopping = asyncio.Event()
        self._last_cancel: float | None = None  # (loop time) see `stop`
        self._chores: list[asyncio.Task[None]] = []  # the heartbeat, the reaper

    async def start(self) -> None:
        if self.reply_topic is not None:
            self._created = True  # before: a create that fails half-way is deleted as well
            await self.bus.create_topics([self.reply_topic], single_partition=False)
        topic = self.reply_topic or topics.topic_name(topics.TOKENS, self.prefix)
        consumer = await self.bus.consumer([topic], None, from_end=True)
        self._reader = asyncio.create_task(self._read(consumer))
        if self.reply_topic is not None:
            self._chores = [asyncio.create_task(self._keep_alive()), asyncio.create_task(self._reap())]

    async def _keep_alive(self) -> None:
        """The reply topic's heartbeat, until `stop`; a failed one is tried again at the next."""
        assert self.reply_topic is not None
        while not self._stopping.is_set():
            try:
                await replies.heartbeat(self.bus, self.prefix, self.reply_topic)
            except Exception as error:
                log.debug("heartbeat of %s: %s", self.reply_topic, error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.heartbeat_s)

    async def _reap(self) -> None:
        """Once, in the background: the leftover reply topics of clients that died."""
        assert self.reply_topic is not None
        try:
            keep = frozenset({self.reply_topic})
            deleted = await replies.reap(self.bus, self.prefix, grace_s=self.reap_grace_s, keep=keep)
            if deleted:
                log.info("deleted %d reply topics of clients gone for %g s", len(deleted), self.reap_grace_s)
        except Exception as error:  # the next client tries again
            log.debug("reaping reply topics: %s", error)

    async def _read(self, consumer: Any) -> None:
        loop = asyncio.get_running_loop()
        last_record = loop.time()
        fetch_wait = FetchWait(consumer, STREAM_FETCH_WAIT_MS)
        try:
            while not self._closing:
                fetch_wait.follow(bool(self._streams))  # short fetch waits while streams are open
                try:
                    records = await consumer.getmany(timeout_ms=100)
                    if records:
                        last_record = loop.time()
                    elif self._streams and loop.time() - last_record > PROBE_S:
                        # aiokafka retries a lost connection without end: ask the broker directly.
                        await self.bus.ping(timeout_s=PROBE_S)
                        last_record = loop.time()
                except Exception as error:
                    # A broker that stops answering ends every open stream with one error, never
                    # a hang; the reader goes on, so that a long-lived client (the gateway)
                    # serves again once the broker is back.
                    gone = PipelineGoneError(f"lost the broker at {self.bootstrap_servers}: {error}")
                    for stream in self._streams.values():
                        stream.queue.put_nowait(gone)
                    last_record = loop.time()
                    continue
                for record in records:
                    self._deliver(record)
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()

    def _deliver(self, record: Any) -> None:
        try:
            event = self._decoder.decode(record.value, record.header(topics.CONTENT_TYPE))
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            # Not ours to judge (the services write this topic), but a stream it belonged to
            # would wait for it: say so.
            log.warning("an undecodable record on %s at offset %d: %s", record.topic, record.offset, error)
            return
        if isinstance(event, TokenEventBatch):
            traceparents = event.traceparents
            for i, one in enumerate(event.events):
                traceparent = traceparents[i] if i < len(traceparents) else ""
                self._deliver_event(one, traceparent.encode() or None)
        else:
            self._deliver_event(event, record.header("traceparent"))

    def _deliver_event(self, event: TokenEvent, traceparent: bytes | None) -> None:
        stream = self._streams.get(event.request_id)
        if stream is not None and traceparent in (None, stream.traceparent):
            stream.queue.put_nowait(event)

    async def stop(self) -> None:
        """Close, and delete the reply topic (unless streams are open: they are aborted, and the
        reaper deletes it); never raises, and ends within 3 PROBE_S where the broker is gone
        already (the reaper deletes the topic then)."""
        # NOTE: the order: the heartbeat ends before the topic is deleted (a commit for a
        # missing topic creates it again on Tansu), and so does the reader (its consumer too).
        # The heartbeat is let finish rather than cancelled between its send and its answer.
        # NOTE: the flag as well as the cancel: on Python 3.11, a cancel that lands as
        # asyncio.wait_for's inner wait completes is swallowed, and the loop would go on.
        # Streams still open (or aborted a moment ago) get events after this: aborted, and the
        # topic is left to the reaper, whose grace outlasts them. Deleted now, a late event would
        # create it again (Tansu, Kafka's auto-create) or wait on a missing topic (without).
        unsettled = list(self._streams)
        loop = asyncio.get_running_loop()
        recent = self._last_cancel is not None and loop.time() - self._last_cancel < LATE_EVENTS_S
        if unsettled and self._reader is not None and not self._reader.done():
            aborts = [Outgoing(self.requests_topic, AbortRequest(request_id=i), i) for i in unsettled]
            try:
                await asyncio.wait_for(send_all(self.bus, aborts, self.prefix), PROBE_S)
            except Exception as error:
                log.debug("could not abort the open requests: %s", error)
        self._stopping.set()
        self._closing = True
        tasks = set(self._chores)
        if self._chores:
            self._chores[1].cancel()  # the reaper: nothing of it needs finishing
        if self._reader is not None:
            self._reader.cancel()
            tasks.add(self._reader)
        pending = (await asyncio.wait(tasks, timeout=PROBE_S))[1] if tasks else set()
        for task in pending:
            task.cancel()
        if self._reader is not None and self._reader.done() and not self._reader.cancelled():
            self._reader.exception()  # retrieved: it was reported to the streams
        if self._created and (unsettled or recent):
            log.info(
                "reply topic %s left to the reaper: %d streams were still open",
                self.reply_topic, len(unsettled), extra={"topic": self.reply_topic},
            )  # fmt: skip
        elif self._created and self.reply_topic is not None and not pending:
            try:  # bounded as `cancel`; if it fails, the reaper deletes the topic later
                await asyncio.wait_for(self.bus.delete_topics([self.reply_topic]), PROBE_S)
                self._created = False
            except Exception as error:
                log.debug("deleting the reply topic %s: %s", self.reply_topic, error)
        elif self._created:  # the broker does not answer (the heartbeat did not finish)
            log.debug("reply topic %s left to the reaper: the broker does not answer", self.reply_topic)
        try:
            await asyncio.wait_for(self.bus.close(), PROBE_S)  # bounded as `cancel`
        except Exception as error:
            log.debug("closing the client's bus: %s", error)

    async def __aenter__(self) -> RequestClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def submit(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        traceparent: bytes | None = None,
        cache_salt: str | None = None,
        chat: ChatOptions | None = None,
        session_id: str | None = None,
    ) -> str:
        """Send a generate request; its events are kept for `stream(request_id)`. A request id
        this client is streaming already is refused (ValueError). `traceparent`: the W3C trace
        context its spans belong under (default: a new trace). `cache_salt`, `session_id` (for the
        `session` router) and `chat` (how `messages` are rendered) as `GenerateRequest`'s fields."""
        assert self._reader is not None, "start the client first (async with Client(...))"
        if self._reader.done():  # it lost the broker: nothing sent now could be read back
            raise PipelineGoneError(f"lost the broker at {self.bootstrap_servers}; start a new client")
        if request_id is not None and request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is being streamed by this client already")
        request = GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids) if prompt_token_ids is not None else None,
            messages=tuple(ChatMessage(**m) for m in messages) if messages is not None else None,
            sampling_params=sampling_params or SamplingParams(),
            priority=priority,
            cache_salt=cache_salt,
            session_id=session_id,
            **_chat_fields(chat),
        )
        traceparent = traceparent or new_traceparent()
        self._streams[request.request_id] = _Stream(traceparent, request.sampling_params.n)
        headers: tuple[tuple[str, bytes], ...] = (("traceparent", traceparent),)
        if self.reply_topic is not None:  # read by this client only: it takes batched events
            headers += ((topics.REPLY_TOPIC, self.reply_topic.encode()), (topics.REPLY_BATCHES, b"1"))
        try:
            await send_all(
                self.bus, [Outgoing(self.requests_topic, request, request.request_id, headers)], self.prefix
            )
        except RecordRejected:  # too large for the broker: the caller's to fix
            self._streams.pop(request.request_id, None)
            raise
        except Exception as error:
            self._streams.pop(request.request_id, None)
            raise PipelineGoneError(f"the request could not be sent: {error}") from error
        return request.request_id

    async def stream(self, request_id: str, timeout_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """The request's events, in order for each sample, until every sample's event with a
        finish_reason came (or an error event, which ends them all). Leaving early (break,
        cancellation, `timeout_s` passed: TimeoutError) aborts the request, as vLLM's streaming
        APIs do. PipelineGoneError when nothing answers any more (see the module)."""
        opened = self._streams[request_id]
        queue = opened.queue
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        finished = False
        next_index = [0] * opened.num_samples  # per sample
        done: set[int] = set()
        try:
            while not finished:
                event = await self._next_event(queue, request_id, deadline)
                if isinstance(event, BaseException):
                    raise event
                if event.error is not None:  # the request failed: it ends every sample
                    finished = True
                    yield event
                    break
                sample = event.sample_index
                if not 0 <= sample < opened.num_samples or sample in done:
                    continue  # not a sample of this request, or a late duplicate
                if event.token_ids and event.index < next_index[sample]:
                    continue  # a duplicate (at-least-once delivery)
                next_index[sample] = event.index + len(event.token_ids)
                if event.finish_reason is not None:
                    done.add(sample)
                finished = len(done) == opened.num_samples
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # also after PipelineGoneError: a pipeline that is only slow stops it
                await self.cancel(request_id)  # (bounded: no wait where nothing answers)

    async def _next_event(
        self, queue: asyncio.Queue[TokenEvent | BaseException], request_id: str, deadline: float | None
    ) -> TokenEvent | BaseException:
        """The next event, within the idle timeout and the request's deadline."""
        loop = asyncio.get_running_loop()
        wait = self.idle_timeout_s if deadline is None else min(self.idle_timeout_s, deadline - loop.time())
        try:
            # NOTE: asyncio.timeout, not wait_for: on Python 3.11 a cancel that lands as
            # wait_for's inner get completes is swallowed, and an abandoned stream would go on.
            async with asyncio.timeout(max(wait, 0.0)):
                return await queue.get()
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline:
                raise TimeoutError(f"request {request_id} passed its timeout") from None
            raise PipelineGoneError(
                f"no event for request {request_id} in {self.idle_timeout_s:g} s: is the pipeline running?"
            ) from None

    async def generate(self, *, timeout_s: float | None = None, **kwargs: Any) -> AsyncIterator[TokenEvent]:
        """`submit` then `stream`: the arguments of `submit`, and `stream`'s `timeout_s`."""
        request_id = await self.submit(**kwargs)
        async for event in self.stream(request_id, timeout_s):
            yield event

    def expect(self, request_id: str, num_samples: int = 1) -> None:
        """Keep the events of a request this client did not submit (another producer wrote it
        to the requests topic, with this client's reply topic or on the shared one) for
        `stream(request_id)`."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is being streamed by this client already")
        self._streams[request_id] = _Stream(traceparent=b"", num_samples=num_samples)

    async def abandon(self, request_id: str) -> None:
        """Stop keeping a submitted request's events, and abort it (nobody will stream it)."""
        self._streams.pop(request_id, None)
        await self.cancel(request_id)

    async def cancel(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". Never raises: on the
        way out, a broker that is gone has nothing to abort."""
        self._last_cancel = asyncio.get_running_loop().time()
        try:
            abort = Outgoing(self.requests_topic, AbortRequest(request_id=request_id), request_id)
            # Bounded: a producer retries a lost broker for its whole request timeout (40 s).
            await asyncio.wait_for(send_all(self.bus, [abort], self.prefix), PROBE_S)
        except Exception as error:
            log.debug("could not cancel request %s: %s", request_id, error)
