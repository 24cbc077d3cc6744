"""The consume -> handle -> produce -> commit loop that every service runs.

Commit policy (one for all services): at-least-once. A batch's offsets are committed only after
every record of the batch was handled and everything the handlers produced was acknowledged;
a crash in between makes the group read the batch again, which the idempotent handlers absorb.
A record that cannot be decoded goes to the dead-letter topic and is committed like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from parkade.schemas import topics
from parkade.services.bus.base import Bus, Outgoing, Record

Handler = Callable[[Any, Record], Awaitable[list[Outgoing]] | list[Outgoing]]


def dead_letter(record: Record, error: Exception) -> Outgoing:
    """The raw record, with why and where from in its headers."""
    headers = (
        *record.headers,
        ("parkade-error", str(error).encode()[:1000]),
        ("parkade-source", f"{record.topic}:{record.partition}:{record.offset}".encode()),
    )
    return Outgoing(topics.DEAD_LETTER, record.value, record.key.decode() if record.key else None, headers)


async def send_all(bus: Bus, outgoing: list[Outgoing], prefix: str) -> None:
    for out in outgoing:
        value = out.message if isinstance(out.message, bytes) else topics.ENCODER.encode(out.message)
        key = out.key.encode() if out.key is not None else None
        await bus.send(topics.topic_name(out.topic, prefix), value, key=key, headers=out.headers)


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
) -> None:
    """Consume the handlers' topics (unprefixed names) until `stop` is set.

    Each record is decoded with its topic's typed decoder and passed to its topic's handler.
    `on_bad_record` decides what an undecodable record produces (default: a dead letter).
    `after_batch` runs after each poll, records or not (the scheduler plans steps there).
    """
    decoders = {topics.topic_name(t, prefix): (topics.decoder(t), h) for t, h in handlers.items()}
    consumer = await bus.consumer(list(decoders), group_id)
    if ready is not None:
        ready()
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
                result = handler(message, record)
                outgoing += await result if asyncio.iscoroutine(result) else result
            if after_batch is not None:
                outgoing += after_batch()
            await send_all(bus, outgoing, prefix)
            if records:
                await consumer.commit()
    finally:
        await consumer.stop()
