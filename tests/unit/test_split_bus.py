"""`SplitBus`: a replica's step topics in memory, every other topic on the broker (here another
in-memory bus standing in for Kafka); and what sharing a process needs of the bus and runtime."""

from __future__ import annotations

import asyncio
import random

import pytest

from parkade.schemas import topics
from parkade.services.bus import MemoryBus
from parkade.services.bus.base import OutgoingRecord
from parkade.services.bus.serve import Service, serve_together
from parkade.services.bus.split import SplitBus, SplitConsumer

PREFIX = "t."
PLANS = topics.topic_name(topics.STEP_PLANS, PREFIX)
RESULTS = topics.topic_name(topics.STEP_RESULTS, PREFIX)
TOKENIZED = topics.topic_name(topics.TOKENIZED, PREFIX)
GENERATED = topics.topic_name(topics.GENERATED, PREFIX)


def split() -> tuple[SplitBus, MemoryBus]:
    broker = MemoryBus()
    return SplitBus(broker, [PLANS, RESULTS]), broker


def test_the_local_topics_never_reach_the_broker_and_the_others_do():
    async def main():
        bus, broker = split()
        await bus.create_topics([PLANS, RESULTS, TOKENIZED, GENERATED])
        await bus.send(PLANS, b"plan")
        await bus.send(GENERATED, b"tokens")
        acks = await bus.queue_many(
            [
                OutgoingRecord(RESULTS, b"r0"),
                OutgoingRecord(GENERATED, b"g1"),
                OutgoingRecord(RESULTS, b"r1"),
                OutgoingRecord(TOKENIZED, b"t0"),
            ]
        )
        assert await acks == [0, 1, 1, 0]  # each record's offset in its own topic, in the order sent
        assert set(broker.topics) == {TOKENIZED, GENERATED}
        assert [r.value for r in broker.topics[GENERATED]] == [b"tokens", b"g1"]
        assert [r.value for r in bus.local.topics[RESULTS]] == [b"r0", b"r1"]
        assert set(await bus.list_topics()) == {PLANS, RESULTS, TOKENIZED, GENERATED}
        await bus.save_progress_many("g.progress", {GENERATED: 2, RESULTS: 1})
        assert await bus.load_progress_many("g.progress", [GENERATED, RESULTS]) == {GENERATED: 2, RESULTS: 1}
        assert broker.progress == {("g.progress", GENERATED): 2}

    asyncio.run(main())


def test_a_consumer_of_both_sides_wakes_for_either_at_once():
    async def main():
        bus, _ = split()
        consumer = await bus.consumer([TOKENIZED, RESULTS], "g")
        assert isinstance(consumer, SplitConsumer)
        loop = asyncio.get_running_loop()
        for topic in (RESULTS, TOKENIZED, RESULTS):
            waiting = asyncio.create_task(consumer.getmany(timeout_ms=5_000))
            await asyncio.sleep(0.02)
            assert not waiting.done()
            started = loop.time()
            await bus.send(topic, topic.encode())
            (record,) = await waiting
            assert record.topic == topic and loop.time() - started < 1.0
        assert await consumer.getmany(timeout_ms=10) == []  # a timeout on both sides: nothing
        await consumer.stop()

    asyncio.run(main())


def test_no_record_is_lost_or_repeated_when_both_sides_race():
    """Records land on both sides at random moments while a reader polls with short timeouts: the
    side whose wait is cancelled must keep what it has not handed out."""

    async def main():
        bus, _ = split()
        consumer = await bus.consumer([TOKENIZED, RESULTS], "g")
        rng = random.Random(7)

        async def produce(topic: str) -> None:
            for i in range(300):
                await bus.send(topic, str(i).encode())
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.random() / 1000)

        producers = [asyncio.create_task(produce(t)) for t in (TOKENIZED, RESULTS)]
        got: dict[str, list[int]] = {TOKENIZED: [], RESULTS: []}
        while sum(map(len, got.values())) < 600:
            for record in await consumer.getmany(timeout_ms=rng.choice([0, 1, 2])):
                got[record.topic].append(int(record.value))
        await asyncio.gather(*producers)
        assert got == {TOKENIZED: list(range(300)), RESULTS: list(range(300))}
        await consumer.stop()

    asyncio.run(main())


def test_commits_go_to_each_side_and_the_local_records_are_trimmed_once_committed():
    async def main():
        bus, broker = split()
        consumer = await bus.consumer([TOKENIZED, RESULTS], "g")
        for i in range(100):
            await bus.send(RESULTS, b"r%d" % i)
        await bus.send(TOKENIZED, b"t")
        assert len(await consumer.getmany()) == 101
        await consumer.commit({RESULTS: 90, TOKENIZED: 1})
        assert broker.offsets["g"] == {TOKENIZED: 1}
        # The records of RESULTS before 90 are gone; offsets go on where they were.
        assert bus.local.base[RESULTS] == 90 and len(bus.local.topics[RESULTS]) == 10
        assert await (await bus.queue_many([OutgoingRecord(RESULTS, b"next")])) == [100]
        await consumer.stop()
        again = await bus.consumer([TOKENIZED, RESULTS], "g")  # resumes from the commit
        assert [r.offset for r in await again.getmany()] == [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100]
        await again.stop()

    asyncio.run(main())


def test_a_trimming_bus_keeps_what_any_live_group_has_not_committed():
    async def main():
        bus = MemoryBus(trim=True)
        fast, slow = await bus.consumer(["x"], "fast"), await bus.consumer(["x"], "slow")
        for i in range(10):
            await bus.send("x", b"%d" % i)
        await fast.getmany()
        await fast.commit({"x": 10})
        assert bus.base.get("x", 0) == 0 and len(bus.topics["x"]) == 10  # "slow" still needs them
        await slow.getmany()
        await slow.commit({"x": 4})
        assert bus.base["x"] == 4 and [r.offset for r in bus.topics["x"]] == list(range(4, 10))
        with pytest.raises(ValueError, match="trimmed"):
            await bus.consumer(["x"], None, start={"x": 0})
        await slow.stop()
        await fast.commit({"x": 10})
        assert bus.topics["x"] == []  # the only live group has read everything
        # An untrimmed bus (the default) keeps every record, as Tansu does.
        keep = MemoryBus()
        reader = await keep.consumer(["x"], "g")
        await keep.send("x", b"0")
        await reader.getmany()
        await reader.commit({"x": 1})
        assert len(keep.topics["x"]) == 1

    asyncio.run(main())


def test_a_reader_without_a_group_trims_what_it_took_unless_another_reader_still_needs_it():
    async def main():
        bus = MemoryBus(trim=True)
        stream = await bus.consumer(["reply"], None, from_end=True)  # a gateway's reply topic
        for i in range(5):
            await bus.send("reply", b"%d" % i)
        assert [r.offset for r in await stream.getmany()] == [0, 1, 2, 3, 4]
        assert bus.base["reply"] == 5 and bus.topics["reply"] == []
        group = await bus.consumer(["reply"], "g")  # from its commit: none, so from what is left
        await bus.send("reply", b"5")
        assert [r.offset for r in await stream.getmany()] == [5]
        assert [r.offset for r in bus.topics["reply"]] == [5]  # the group has not committed it
        assert [r.offset for r in await group.getmany()] == [5]
        await group.commit({"reply": 6})
        assert bus.topics["reply"] == []
        await bus.send("reply", b"6")
        await group.commit({"reply": 7})
        assert [r.offset for r in bus.topics["reply"]] == [6]  # the stream has not taken it
        assert [r.value for r in await stream.getmany()] == [b"6"]
        assert bus.topics["reply"] == []

    asyncio.run(main())


def test_buses_of_one_process_share_their_local_topics():
    """A gateway and its tokenizer: each its own bus (and broker connection), one reply topic in
    memory between them; every other topic, another client's reply topic too, on the broker."""

    async def main():
        broker = MemoryBus()
        reply, other = f"{PREFIX}tokens.0123456789ab", f"{PREFIX}tokens.ba9876543210"
        gateway = SplitBus(broker, [reply])
        tokenizer = SplitBus(broker, [reply], local=gateway.local)
        assert tokenizer.local is gateway.local
        stream = await gateway.consumer([reply], None, from_end=True)
        await tokenizer.create_topics([reply])
        await tokenizer.send(reply, b"events")
        await tokenizer.send(other, b"theirs")
        assert [r.value for r in await stream.getmany(timeout_ms=1000)] == [b"events"]
        assert set(broker.topics) == {other}
        assert gateway.local.topics[reply] == []  # taken by its one reader: gone

    asyncio.run(main())


def test_services_claimed_together_refuse_a_second_instance_of_either():
    from parkade.services.bus.instances import DuplicateInstanceError, single_instance

    fast = dict(heartbeat_s=0.02, claim_wait_s=0.15)

    async def main():
        bus = MemoryBus()
        async with single_instance(bus, ("scheduler", "executor"), "t.", "replica", **fast):
            with pytest.raises(DuplicateInstanceError, match="another executor is serving"):
                async with single_instance(bus, "executor", "t.", "alone", **fast):
                    pass
            with pytest.raises(DuplicateInstanceError, match=r"another (scheduler|executor) is serving"):
                async with single_instance(bus, ("scheduler", "executor"), "t.", "second", **fast):
                    pass
            async with single_instance(bus, "tokenizer", "t.", "other", **fast):
                pass
        async with single_instance(bus, ("scheduler", "executor"), "t.", "restarted", **fast):
            pass

    asyncio.run(main())


def test_services_served_together_are_ready_together_and_one_failure_stops_both():
    from parkade.schemas import AbortRequest

    class Ping(Service):
        group_id = "ping"
        consumes = (topics.REQUESTS,)

        def __init__(self, fail: bool = False) -> None:
            self.fail, self.seen, self.stopped = fail, [], False

        def on_record(self, message, record):
            self.seen.append(message.request_id)
            return []

        async def start(self, bus, prefix):
            if self.fail:
                raise RuntimeError("boom")

        async def stop(self):
            self.stopped = True

    class Pong(Ping):
        group_id = "pong"

    async def main():
        import msgspec

        bus, stop, ready = MemoryBus(), asyncio.Event(), []
        requests = topics.topic_name(topics.REQUESTS, PREFIX)
        await bus.send(requests, msgspec.msgpack.encode(AbortRequest(request_id="a")))
        ping, pong = Ping(), Pong()
        task = asyncio.create_task(
            serve_together(bus, [ping, pong], prefix=PREFIX, stop=stop, ready=lambda: ready.append(1))
        )
        while not (ping.seen and pong.seen):
            await asyncio.sleep(0.01)
        assert ready == [1]
        stop.set()
        await task
        assert ping.stopped and pong.stopped
        # One that fails at its start: the other is stopped too, and the error is the failure's.
        healthy = Pong()
        with pytest.raises(RuntimeError, match="boom"):
            await asyncio.wait_for(
                serve_together(bus, [Ping(fail=True), healthy], prefix=PREFIX, stop=asyncio.Event()), 10
            )
        assert healthy.stopped

    asyncio.run(main())
