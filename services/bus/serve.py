"""The consume -> handle -> produce -> commit loop that every service runs.

Commit policy (one for all services): at-least-once. Offsets are committed only after every
record up to them was handled and everything the handlers produced was acknowledged: when a poll
comes back empty, once `COMMIT_INTERVAL_S` has passed since the last commit, and at a clean stop.
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

log = logging.getLogger(__name__)

Handler = Callable[[Any, Record], Awaitable[list[Outgoing]] | list[Outgoing]]


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


SendErrorHandler = Callable[[Outgoing, Exception], list[Outgoing]]

COMMIT_INTERVAL_S = 0.1  # while records keep coming, a commit once this long has passed

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
        records.append(OutgoingRecord(name, value, key, headers))
    return await bus.queue_many(records)


async def serve(
    bus: Bus,
    *,
    prefix: str,
    group_id: str,
    handlers: dict[str, Handler],
    on_bad_record: Callable[[Record, Exception], list[Outgoing]] | None = None,
    after_batch: Callable[[], list[Outgoing]] | None = None,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
    poll_ms: int = 50,
    send_each: bool = False,
    commit_interval_s: float = COMMIT_INTERVAL_S,
    on_send_error: SendErrorHandler | None = None,
    on_sent: Callable[[Outgoing, int], None] | None = None,
    low_watermarks: Callable[[], dict[str, int]] | None = None,
    progress: Callable[[], dict[str, int]] | None = None,
    metrics: ServiceMetrics | None = None,
) -> None:
    """Consume the handlers' topics (unprefixed names) until `stop` is set.

    Each record is decoded with its topic's typed decoder and passed to its topic's handler.
    `on_bad_record` decides what an undecodable record produces (default: a dead letter).
    `after_batch` runs after each poll, records or not (the scheduler plans steps there).
    `send_each` sends what each record produced before handling the next one, rather than once per
    batch: for a slow handler whose output someone waits for (the executor: a poll may bring plans
    N and N+1, and result N must not wait for step N+1's compute). Outputs are queued without
    waiting for the broker: only the next queueing waits for the previous acknowledgements, by
    then long done (a round trip per step would idle the executor).

    No batch ends with a wait for a commit: a commit (of every record handled so far, once
    everything they produced was acknowledged) happens when `commit_interval_s` has passed since
    the last one, when a poll comes back empty, and when the loop stops cleanly. The
    acknowledgement and commit round trips after every batch had the executor idle for about 14%
    of a pipeline run; a crash now redelivers up to `commit_interval_s` of records, which the
    idempotent handlers absorb.

    For a service that rebuilds its state from the log after a restart: `low_watermarks()` (by
    topic, unprefixed) holds a topic's commit back to the oldest record still needed (the oldest
    unfinished request's), so that a restart reads it again; `progress()` (by topic) are offsets
    the service keeps for itself (`Bus.save_progress` under the group `<group_id>.progress`),
    saved after each commit; `on_sent(out, offset)` hears each record's offset once acknowledged.
    """
    decoders = {topics.topic_name(t, prefix): (topics.TopicDecoder(t), h) for t, h in handlers.items()}
    consumer = await bus.consumer(list(decoders), group_id)
    if ready is not None:
        ready()
    loop = asyncio.get_running_loop()
    sends = _Sends(bus, prefix, on_send_error, on_sent)
    handled: dict[str, int] = {}  # topic -> the offset after the last record handled
    uncommitted, last_commit = False, loop.time()
    if metrics is not None:
        metrics.watch_consumer(consumer.highwaters, handled)

    saved: dict[str, int] = {}  # the progress saved last, by topic

    async def commit() -> None:
        offsets = dict(handled)
        for topic, low in (low_watermarks() if low_watermarks else {}).items():
            name = topics.topic_name(topic, prefix)
            if name in offsets:
                offsets[name] = min(offsets[name], low)
        if not await _commit(consumer, offsets):
            return  # the progress must not run ahead of what a restart reads again
        for topic, offset in (progress() if progress else {}).items():
            # NOTE: after the commit: a restart that finds the commit newer than the progress
            # reads more of the log than it needs, never less.
            if saved.get(topic) != offset:
                await bus.save_progress(f"{group_id}.progress", topics.topic_name(topic, prefix), offset)
                saved[topic] = offset

    try:
        while not stop.is_set():
            records = await consumer.getmany(timeout_ms=poll_ms)
            outgoing: list[Outgoing] = []
            for record in records:
                handled[record.topic] = record.offset + 1
                decoder, handler = decoders[record.topic]
                try:
                    message = decoder.decode(record.value, record.header(topics.CONTENT_TYPE))
                except (msgspec.DecodeError, msgspec.ValidationError) as error:
                    outgoing += (
                        on_bad_record(record, error) if on_bad_record else [dead_letter(record, error)]
                    )
                    continue
                try:
                    result = handler(message, record)
                    outgoing += await result if asyncio.iscoroutine(result) else result
                except Exception as error:
                    # NOTE: a record that breaks its handler is set aside, not retried: retrying
                    # would fail the same way on every restart and stall everything behind it.
                    log.exception("handler failed on %s:%d:%d", record.topic, record.partition, record.offset)
                    outgoing += (
                        on_bad_record(record, error) if on_bad_record else [dead_letter(record, error)]
                    )
                if send_each and outgoing:
                    await sends.queue_after(outgoing)
                    outgoing = []
            if after_batch is not None:
                # First: the scheduler's next step plans must not queue behind token records.
                outgoing = after_batch() + outgoing
            if outgoing:
                await sends.queue_after(outgoing)
            uncommitted = uncommitted or bool(records)
            if not records or loop.time() - last_commit >= commit_interval_s:
                await sends.drain()  # what the handled records produced is in the log
                if uncommitted:
                    await commit()
                    uncommitted, last_commit = False, loop.time()
        await sends.drain()
        if uncommitted:
            await commit()
    finally:
        # On an error, nothing more is committed: what was not is read again after a restart.
        await consumer.stop()


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

    def __init__(
        self,
        bus: Bus,
        prefix: str,
        on_send_error: SendErrorHandler | None,
        on_sent: Callable[[Outgoing, int], None] | None,
    ) -> None:
        self.bus, self.prefix = bus, prefix
        self.on_send_error = on_send_error or (lambda out, error: [rejected_letter(out, error)])
        self.on_sent = on_sent
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
                    if self.on_sent is not None:
                        self.on_sent(out, outcome)
                    continue
                log.error("the broker refused a record for %s (key %s): %s", out.topic, out.key, outcome)
                if not are_answers:  # an answer that is refused too is only logged
                    answers += self.on_send_error(out, outcome)
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
