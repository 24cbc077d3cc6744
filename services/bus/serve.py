"""The consume -> handle -> produce -> commit loop that every service runs.

Commit policy (one for all services): at-least-once. Offsets are committed only after every
record up to them was handled and everything the handlers produced was acknowledged: when a poll
comes back empty, once `COMMIT_INTERVAL_S` has passed since the last commit, and at a clean stop.
A crash in between makes the group read those records again, which the idempotent handlers
absorb.
A record that cannot be decoded, or that makes its handler raise, goes to the dead-letter topic
(or, where the handler knows the request, becomes an error event) and is committed like any
other. Every record sent carries the schema version in a `parkade-schema` header.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from parkade.schemas import topics
from parkade.services.bus.base import Bus, CommitError, Consumer, Outgoing, OutgoingRecord, Record

log = logging.getLogger(__name__)

Handler = Callable[[Any, Record], Awaitable[list[Outgoing]] | list[Outgoing]]


def dead_letter(record: Record, error: Exception) -> Outgoing:
    """The raw record, with why and where from in its headers."""
    headers = (
        *record.headers,
        ("parkade-error", str(error).encode()[:1000]),
        ("parkade-source", f"{record.topic}:{record.partition}:{record.offset}".encode()),
    )
    return Outgoing(topics.DEAD_LETTER, record.value, record.key.decode() if record.key else None, headers)


COMMIT_INTERVAL_S = 0.1  # while records keep coming, a commit once this long has passed

SCHEMA_HEADER = ("parkade-schema", str(topics.SCHEMA_VERSION).encode())


async def send_all(bus: Bus, outgoing: list[Outgoing], prefix: str) -> None:
    await (await queue_all(bus, outgoing, prefix))


async def queue_all(bus: Bus, outgoing: list[Outgoing], prefix: str) -> Awaitable[None]:
    """Queue the records; the awaitable returned completes once the broker has them all."""
    records = []
    for out in outgoing:
        value = out.message if isinstance(out.message, bytes) else topics.ENCODER.encode(out.message)
        key = out.key.encode() if out.key is not None else None
        headers = out.headers if isinstance(out.message, bytes) else (*out.headers, SCHEMA_HEADER)
        records.append(OutgoingRecord(topics.topic_name(out.topic, prefix), value, key, headers))
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
    """
    decoders = {topics.topic_name(t, prefix): (topics.decoder(t), h) for t, h in handlers.items()}
    consumer = await bus.consumer(list(decoders), group_id)
    if ready is not None:
        ready()
    loop = asyncio.get_running_loop()
    acks: list[Awaitable[None]] = []  # of the records queued last, until known acknowledged
    uncommitted, last_commit = False, loop.time()
    try:
        while not stop.is_set():
            records = await consumer.getmany(timeout_ms=poll_ms)
            outgoing: list[Outgoing] = []
            for record in records:
                decoder, handler = decoders[record.topic]
                try:
                    message = decoder.decode(record.value)
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
                    acks = await _queue_after(acks, bus, outgoing, prefix)
                    outgoing = []
            if after_batch is not None:
                # First: the scheduler's next step plans must not queue behind token records.
                outgoing = after_batch() + outgoing
            if outgoing:
                acks = await _queue_after(acks, bus, outgoing, prefix)
            uncommitted = uncommitted or bool(records)
            if not records or loop.time() - last_commit >= commit_interval_s:
                await asyncio.gather(*acks)  # what the handled records produced is in the log
                acks = []
                if uncommitted:
                    await _commit(consumer)
                    uncommitted, last_commit = False, loop.time()
        await asyncio.gather(*acks)
        if uncommitted:
            await _commit(consumer)
    finally:
        # On an error, nothing more is committed: what was not is read again after a restart.
        await consumer.stop()


async def _queue_after(
    acks: list[Awaitable[None]], bus: Bus, outgoing: list[Outgoing], prefix: str
) -> list[Awaitable[None]]:
    """Queue `outgoing` once everything queued before it was acknowledged; -> the pending acks.

    NOTE: so that a send that failed for good raises before anything later goes out: result N+1
    must never land after a lost result N. The wait is short: the earlier records had a whole
    handler call (a step, for the executor) to be acknowledged.
    """
    await asyncio.gather(*acks)
    return [await queue_all(bus, outgoing, prefix)]


async def _commit(consumer: Consumer) -> None:
    try:
        await consumer.commit()
    except CommitError:
        # A rebalance took the partitions: the next owner reads the records again, which the
        # idempotent handlers absorb.
        log.warning("commit failed; the records will be delivered again", exc_info=True)
