"""The consume -> handle -> produce -> commit loop that every service runs.

Commit policy (one for all services): at-least-once. Offsets are committed only after every
record up to them was handled and everything the handlers produced was acknowledged: once
`COMMIT_INTERVAL_S` has passed since the last commit (looked at after every poll), and at a clean
stop.
A crash in between makes the group read those records again, which the idempotent handlers
absorb.
A record that cannot be decoded, or that makes its handler raise, goes to the dead-letter topic
(or, where the handler knows the request, becomes an error event) and is committed like any
other. A record the broker refuses for what it is (too large) is handed to `on_send_error`, which
answers for it (an error event, a failed step); by default a dead letter says what was lost.
Any other send failure (the broker is away) ends the loop without a commit: the records are
read again after a restart. Every record sent carries the schema version in a `parkade-schema`
header.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from parkade.schemas import topics
from parkade.services.bus.base import (
    Bus,
    CommitError,
    Consumer,
    Outcome,
    Outgoing,
    OutgoingRecord,
    Record,
    RecordRejected,
)
from parkade.services.common.metrics import ServiceMetrics
from parkade.services.common.timeline import StepTimeline

log = logging.getLogger(__name__)


def dead_letter(record: Record, error: Exception) -> Outgoing:
    """The raw record, with why and where from in its headers."""
    log.warning(
        "dead letter from %s offset %d: %s", record.topic, record.offset, error,
        extra={"topic": record.topic, "offset": record.offset, "reason": str(error)[:300]},
    )  # fmt: skip
    headers = (
        *record.headers,
        ("parkade-error", str(error).encode()[:1000]),
        ("parkade-source", f"{record.topic}:{record.partition}:{record.offset}".encode()),
    )
    return Outgoing(topics.DEAD_LETTER, record.value, record.key.decode() if record.key else None, headers)


def rejected_letter(out: Outgoing, error: Exception) -> Outgoing:
    """What is left of a record the broker refused: a dead letter with no value, whose headers
    say where it was going and why it is not there."""
    headers = (
        *out.headers,
        ("parkade-error", str(error).encode()[:1000]),
        ("parkade-topic", out.topic.encode()),
    )
    return Outgoing(topics.DEAD_LETTER, b"", out.key, headers)


COMMIT_INTERVAL_S = 0.1  # a commit once this long has passed since the last one (see `serve`)
# The broker's fetch wait while a service has work in flight (`Service.busy`): each hop of a
# step's round trip and of a token's way to its client waits for a fetch (see
# Consumer.set_fetch_wait); while idle, the bus's default (fewer fetches, less CPU).
BUSY_FETCH_WAIT_MS = 2
# The busy fetch wait of the readers off the step loop (the tokenizer, each client: the gateway):
# the executor and scheduler do not wait for them, so a longer wait delays a token by a few ms at
# most and never slows a stream's pace, and a fetch brings several steps' records (one reply batch
# for them). Measured on `parkade up` under vLLM's client (tiny-llama, 64 streams of 128 tokens),
# against 2 ms: the tokenizer's CPU 0.45 against 0.56-0.72 s a round, the gateway's 0.70 against
# 0.88-1.14, the broker's 0.66-0.71 against 0.82-0.96; output 2,183 and 2,589 tok/s against
# 1,976 and 2,408 (alternated), mean TTFT 446-465 against 553-667 ms.
STREAM_FETCH_WAIT_MS = 10


class FetchWait:
    """A consumer's fetch wait, following whether its reader is busy: `busy_ms` while it is
    (BUSY_FETCH_WAIT_MS on the step loop, STREAM_FETCH_WAIT_MS off it), the bus's default while
    not (set only when that changes)."""

    def __init__(self, consumer: Consumer, busy_ms: int = BUSY_FETCH_WAIT_MS) -> None:
        self.consumer, self.busy, self.busy_ms = consumer, False, busy_ms

    def follow(self, busy: bool) -> None:
        if busy != self.busy:
            self.busy = busy
            self.consumer.set_fetch_wait(self.busy_ms if busy else None)


SCHEMA_HEADER = ("parkade-schema", str(topics.SCHEMA_VERSION).encode())


async def send_all(bus: Bus, outgoing: list[Outgoing], prefix: str) -> list[int]:
    """Send and wait; -> the records' offsets. Raises `RecordRejected` if the broker refused one."""
    offsets = []
    for outcome in await (await queue_all(bus, outgoing, prefix)):
        if isinstance(outcome, RecordRejected):
            raise outcome
        offsets.append(outcome)
    return offsets


async def queue_all(bus: Bus, outgoing: list[Outgoing], prefix: str) -> Awaitable[list[Outcome]]:
    """Queue the records; the awaitable returned completes once the broker has them all (see
    `Bus.queue_many`)."""
    records = []
    for out in outgoing:
        value = out.message if isinstance(out.message, bytes) else topics.encode(out.message, out.headers)
        key = out.key.encode() if out.key is not None else None
        headers = out.headers if isinstance(out.message, bytes) else (*out.headers, SCHEMA_HEADER)
        name = out.to or topics.topic_name(out.topic, prefix)
        records.append(OutgoingRecord(name, value, key, headers, reply=out.to is not None))
    return await bus.queue_many(records)


class Service:
    """A service as `serve` runs it: the topics it `consumes`, and the methods `serve` calls around
    them (declared handlers, as FastStream's subscribers). Each service's handler subclasses it
    and overrides what applies; its `main.py` adds the I/O (`start`, `stop`, an async
    `on_record`). The defaults do nothing, or dead-letter.

    Commit policy and send order are `serve`'s, the same for every service (see the module)."""

    group_id: str  # the consumer group, and the name of the progress group (`progress`)
    consumes: tuple[str, ...] = ()  # its topics, unprefixed
    poll_ms = 50
    # Send what each record produced before handling the next one, rather than once per poll:
    # for a slow handler whose output someone waits for (the executor: a poll may bring plans N
    # and N+1, and result N must not wait for step N+1's compute).
    send_each = False
    busy_fetch_wait_ms = BUSY_FETCH_WAIT_MS  # see FetchWait
    metrics: ServiceMetrics | None = None  # its consumer lag is watched when set
    timeline: StepTimeline | None = None  # the scheduler and executor mark their steps in it when set
    # What it claims on the instances topic (see instances.py): its service's name, or for an
    # engine replica's scheduler and executor `<service>.replica-R` (one of each per replica).
    instance_name: str | None = None

    def enable_metrics(self) -> ServiceMetrics:
        """Measure from now on (the service serves them with --metrics-port)."""
        self.metrics = ServiceMetrics()
        return self.metrics

    def own_topics(self) -> tuple[str, ...]:
        """Topics (unprefixed) it needs beyond every deployment's (a replica's step topics)."""
        return tuple(t for t in self.consumes if t not in topics.ALL_TOPICS)

    async def start(self, bus: Bus, prefix: str) -> None:
        """Before the first poll (an announcement, reading the log back)."""

    async def stop(self) -> None:
        """After the last poll, whether the loop ended cleanly or not."""

    def on_record(self, message: Any, record: Record) -> list[Outgoing] | Awaitable[list[Outgoing]]:
        """A decoded record of one of the topics it consumes; -> what it produces."""
        raise NotImplementedError

    def on_bad_record(self, record: Record, error: Exception) -> list[Outgoing]:
        """A record that could not be decoded, or that made `on_record` raise."""
        return [dead_letter(record, error)]

    def after_batch(self) -> list[Outgoing]:
        """After each poll, records or not (sent before what the records produced)."""
        return []

    def coalesce(self, outgoing: list[Outgoing]) -> list[Outgoing]:
        """What one poll produced, as it is sent: records merged where their readers take that
        (the tokenizer: token events into batches, see replies.batch_events)."""
        return outgoing

    def busy(self) -> bool:
        """Whether work is in flight whose next record someone waits for (short fetch waits)."""
        return False

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused `out` for what it is (too large): the records that answer for it."""
        return [rejected_letter(out, error)]

    def on_sent(self, out: Outgoing, offset: int) -> None:
        """`out` was acknowledged at `offset`."""

    def low_watermarks(self) -> dict[str, int]:
        """By topic (unprefixed): the oldest offset a restart must read again; the commit never
        passes it (the oldest unfinished request's record)."""
        return {}

    def progress(self) -> dict[str, int]:
        """By topic (unprefixed): offsets the service keeps for itself, saved after each commit
        (`Bus.save_progress` under the group `<group_id>.progress`)."""
        return {}


async def serve(
    bus: Bus,
    service: Service,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
    commit_interval_s: float = COMMIT_INTERVAL_S,
) -> None:
    """Run `service` on the topics it consumes (prefixed with `prefix`) until `stop` is set.

    Each record is decoded with its topic's typed decoder and passed to `service.on_record`.
    Outputs are queued without waiting for the broker: only the next queueing waits for the
    previous acknowledgements, by then long done (a round trip per step would idle the executor).

    No batch ends with a wait for a commit: a commit (of every record handled so far, once
    everything they produced was acknowledged) happens after the first poll, empty or not, once
    `commit_interval_s` has passed since the last one, and when the loop stops cleanly. The
    acknowledgement and commit round trips after every batch had the executor idle for about 14%
    of a pipeline run; a crash now redelivers up to `commit_interval_s` of records (and a poll),
    which the idempotent handlers absorb. An empty poll used to commit too: on the step loop,
    where the poll between two results is empty, that was a commit (and a save of the progress)
    nearly every step: the scheduler's commit requests over one round of vLLM's benchmark on
    `parkade up` (64 streams, with the client's start-up) went from 120 to 27.
    """
    await service.start(bus, prefix)
    try:
        decoders = {topics.topic_name(t, prefix): topics.TopicDecoder(t) for t in service.consumes}
        consumer = await bus.consumer(list(decoders), service.group_id)
        try:
            if ready is not None:
                ready()
            await _Loop(bus, service, consumer, decoders, prefix, commit_interval_s).run(stop)
        finally:
            # On an error, nothing more is committed: what was not is read again after a restart.
            await consumer.stop()
    finally:
        await service.stop()


async def serve_together(
    bus: Bus,
    services: list[Service],
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
) -> None:
    """`serve` each of `services` (sharing a process, see runtime.py) until `stop` is set;
    `ready` once all of them consume. One that fails stops the others, and its error is raised."""
    if len(services) == 1:
        await serve(bus, services[0], prefix=prefix, stop=stop, ready=ready)
        return
    waiting = len(services)

    def one_ready() -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0 and ready is not None:
            ready()

    tasks = [asyncio.create_task(serve(bus, s, prefix=prefix, stop=stop, ready=one_ready)) for s in services]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Loop:
    """`serve`'s consume -> handle -> produce -> commit loop, over one consumer."""

    def __init__(
        self,
        bus: Bus,
        service: Service,
        consumer: Consumer,
        decoders: dict[str, topics.TopicDecoder],
        prefix: str,
        commit_interval_s: float,
    ) -> None:
        self.bus, self.service, self.consumer = bus, service, consumer
        self.decoders, self.prefix, self.commit_interval_s = decoders, prefix, commit_interval_s
        self.sends = _Sends(bus, prefix, service)
        self.handled: dict[str, int] = {}  # topic -> the offset after the last record handled
        self.saved: dict[str, int] = {}  # the progress saved last, by topic
        if service.metrics is not None:
            service.metrics.watch_consumer(consumer.highwaters, self.handled)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        uncommitted, last_commit = False, loop.time()
        fetch_wait = FetchWait(self.consumer, self.service.busy_fetch_wait_ms)
        while not stop.is_set():
            fetch_wait.follow(self.service.busy())
            records = await self.consumer.getmany(timeout_ms=self.service.poll_ms)
            outgoing = await self._handle(records)
            # First: the scheduler's next step plans must not queue behind token records.
            outgoing = self.service.coalesce(self.service.after_batch() + outgoing)
            if outgoing:
                await self.sends.queue_after(outgoing)
            uncommitted = uncommitted or bool(records)
            due = loop.time() - last_commit >= self.commit_interval_s
            if not records or due:
                await self.sends.drain()  # what the handled records produced is in the log
                if uncommitted and due:
                    await self._commit()
                    uncommitted, last_commit = False, loop.time()
        await self.sends.drain()
        if uncommitted:
            await self._commit()

    async def _handle(self, records: list[Record]) -> list[Outgoing]:
        """Each record through the service; -> what they produced and is not sent yet."""
        service, outgoing = self.service, []
        for record in records:
            self.handled[record.topic] = record.offset + 1
            try:
                message = self.decoders[record.topic].decode(record.value, record.header(topics.CONTENT_TYPE))
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                outgoing += service.on_bad_record(record, error)
                continue
            try:
                result = service.on_record(message, record)
                outgoing += await result if inspect.isawaitable(result) else result
            except Exception as error:
                # NOTE: a record that breaks its handler is set aside, not retried: retrying
                # would fail the same way on every restart and stall everything behind it.
                log.exception("handler failed on %s:%d:%d", record.topic, record.partition, record.offset)
                outgoing += service.on_bad_record(record, error)
            if service.send_each and outgoing:
                await self.sends.queue_after(outgoing)
                outgoing = []
        return outgoing

    async def _commit(self) -> None:
        offsets = dict(self.handled)
        for topic, low in self.service.low_watermarks().items():
            name = topics.topic_name(topic, self.prefix)
            if name in offsets:
                offsets[name] = min(offsets[name], low)
        if not await _commit(self.consumer, offsets):
            return  # the progress must not run ahead of what a restart reads again
        for topic, offset in self.service.progress().items():
            # NOTE: after the commit: a restart that finds the commit newer than the progress
            # reads more of the log than it needs, never less.
            if self.saved.get(topic) != offset:
                name = topics.topic_name(topic, self.prefix)
                await self.bus.save_progress(f"{self.service.group_id}.progress", name, offset)
                self.saved[topic] = offset


async def read_log(
    bus: Bus, topic: str, prefix: str, start: int, end: int, *, timeout_s: float = 120.0
) -> list[Any]:
    """The decoded records of `topic` (unprefixed) from offset `start` up to `end`, a record
    known to be there (one this process sent: the end of what it must read, where the broker's
    end offsets may lag); records that cannot be decoded are skipped."""
    name = topics.topic_name(topic, prefix)
    decoder = topics.TopicDecoder(topic)
    consumer = await bus.consumer([name], None, start={name: start})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    messages: list[Any] = []
    try:
        while True:
            if loop.time() > deadline:
                raise TimeoutError(f"{name} did not reach offset {end} within {timeout_s:g} s")
            for record in await consumer.getmany(timeout_ms=200):
                if record.offset >= end:
                    return messages
                try:
                    messages.append(decoder.decode(record.value, record.header(topics.CONTENT_TYPE)))
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                    log.warning("skipping an undecodable record at %s offset %d", name, record.offset)
    finally:
        await consumer.stop()


class _Sends:
    """The records queued and not yet known acknowledged, and the answers for refused ones."""

    def __init__(self, bus: Bus, prefix: str, service: Service) -> None:
        self.bus, self.prefix, self.service = bus, prefix, service
        # (records, their acknowledgements, whether they answer for refused ones)
        self.pending: list[tuple[list[Outgoing], Awaitable[list[Outcome]], bool]] = []

    async def queue_after(self, outgoing: list[Outgoing]) -> None:
        """Queue `outgoing` once everything queued before it was acknowledged.

        NOTE: so that a send that failed for good raises before anything later goes out: result
        N+1 must never land after a lost result N. The wait is short: the earlier records had a
        whole handler call (a step, for the executor) to be acknowledged. The answers for
        records refused meanwhile go first.
        """
        answers = await self._settle()
        if answers:
            self.pending.append((answers, await queue_all(self.bus, answers, self.prefix), True))
        self.pending.append((outgoing, await queue_all(self.bus, outgoing, self.prefix), False))

    async def drain(self) -> None:
        """Until everything queued, answers included, is acknowledged or answered for."""
        while self.pending:
            answers = await self._settle()
            if answers:
                self.pending.append((answers, await queue_all(self.bus, answers, self.prefix), True))

    async def _settle(self) -> list[Outgoing]:
        """Wait for the pending acknowledgements; -> the answers for the records refused."""
        pending, self.pending = self.pending, []
        answers: list[Outgoing] = []
        for outgoing, acks, are_answers in pending:
            for out, outcome in zip(outgoing, await acks, strict=True):
                if not isinstance(outcome, RecordRejected):
                    for part in out.parts or (out,):
                        self.service.on_sent(part, outcome)
                    continue
                log.error("the broker refused a record for %s (key %s): %s", out.topic, out.key, outcome)
                if not are_answers:  # an answer that is refused too is only logged
                    for part in out.parts or (out,):
                        answers += self.service.on_send_error(part, outcome)
        return answers


async def _commit(consumer: Consumer, offsets: dict[str, int]) -> bool:
    try:
        await consumer.commit(offsets)
    except CommitError as error:
        # Tried again at the next commit; a restart meanwhile reads the records again, which the
        # idempotent handlers absorb.
        log.warning("commit failed (%s); the records will be delivered again", error)
        return False
    return True
