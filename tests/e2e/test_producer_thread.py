"""A `KafkaBus` whose producer runs on a loop of its own (the gateway's): records reach the broker
while the caller's loop is busy, in order, each answered for (an offset, or its refusal), and its
thread ends with the bus."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from parkade.services.bus.base import OutgoingRecord, RecordRejected
from parkade.services.bus.kafka import KafkaBus

pytestmark = pytest.mark.e2e


def producer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.endswith("-producer")]


def test_records_are_acknowledged_while_the_callers_loop_is_busy(bootstrap_servers):
    """The gateway's burst: its loop runs long iterations of HTTP work, during which a record it
    queued must still go out. On the caller's own loop (no thread) it would wait for them."""
    topic = f"pt-busy-{uuid.uuid4().hex[:8]}"

    async def main():
        bus = KafkaBus(bootstrap_servers, client_id="pt-test", producer_thread=True)
        try:
            await bus.create_topics([topic])
            await (await bus.queue_many([OutgoingRecord(topic, b"warm")]))  # producer and metadata
            # A task: on the caller's own loop (no thread) it would start only after the sleep.
            acks = asyncio.ensure_future(await bus.queue_many([OutgoingRecord(topic, b"during")]))
            time.sleep(1.0)  # a long iteration of other work: this loop does not come round
            await asyncio.sleep(0)  # one iteration: the answer that came meanwhile is delivered
            assert acks.done(), "the record waited for the caller's loop"
            assert await acks == [1]
        finally:
            await bus.close()

    asyncio.run(main())


def test_concurrent_senders_records_arrive_in_order_and_refusals_are_answered(bootstrap_servers):
    topic = f"pt-order-{uuid.uuid4().hex[:8]}"
    big = OutgoingRecord(topic, b"x" * (2 * 2**20))  # over aiokafka's max_request_size (1 MiB)

    async def sender(bus: KafkaBus, name: str) -> list[object]:
        # A few records per call, as a service's poll sends; every call queued before any is
        # awaited, as `serve` does: the order must hold across calls, not only within one.
        queued = []
        for i in range(0, 40, 4):
            batch = [
                OutgoingRecord(topic, f"{name}:{j}".encode(), key=name.encode()) for j in range(i, i + 4)
            ]
            queued.append(await bus.queue_many(batch))
        return [offset for acks in queued for offset in await acks]

    async def main():
        bus = KafkaBus(bootstrap_servers, client_id="pt-test", producer_thread=True)
        try:
            await bus.create_topics([topic])
            results = await asyncio.gather(*(sender(bus, f"s{k}") for k in range(4)))
            refused = await (await bus.queue_many([big, OutgoingRecord(topic, b"after")]))
            await bus.send(topic, b"last")
            consumer = await bus.consumer([topic], None)
            seen: list[bytes] = []
            deadline = time.monotonic() + 30
            while len(seen) < 162 and time.monotonic() < deadline:
                seen += [r.value for r in await consumer.getmany(timeout_ms=200)]
            await consumer.stop()
        finally:
            await bus.close()
        offsets = [o for outcome in results for o in outcome]
        assert sorted(offsets) == list(range(160))  # each acknowledged with its own offset
        assert isinstance(refused[0], RecordRejected) and refused[1] == 160
        assert len(seen) == 162 and seen[-2:] == [b"after", b"last"]
        for k in range(4):  # each sender's records in the order it sent them
            mine = [v for v in seen if v.startswith(f"s{k}:".encode())]
            assert mine == [f"s{k}:{j}".encode() for j in range(40)]

    asyncio.run(main())


def test_the_producers_thread_ends_with_the_bus(bootstrap_servers):
    topic = f"pt-close-{uuid.uuid4().hex[:8]}"

    async def main():
        bus = KafkaBus(bootstrap_servers, client_id="pt-closing", producer_thread=True)
        await bus.create_topics([topic])
        await bus.send(topic, b"v")
        assert "pt-closing-producer" in producer_threads()
        await bus.close()
        assert "pt-closing-producer" not in producer_threads()
        await bus.close()  # twice: nothing left to do

    asyncio.run(main())
