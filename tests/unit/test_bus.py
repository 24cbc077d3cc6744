"""The consume loop's delivery semantics, on the in-memory bus."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from parkade.schemas import AbortRequest, topics
from parkade.services.bus import MemoryBus
from parkade.services.bus.serve import COMMIT_INTERVAL_S, Service, serve

PREFIX = "t."
REQUESTS = topics.topic_name(topics.REQUESTS, PREFIX)
DEAD = topics.topic_name(topics.DEAD_LETTER, PREFIX)


def abort(request_id: str) -> bytes:
    return msgspec.msgpack.encode(AbortRequest(request_id=request_id))


class _Requests(Service):
    """A service of the requests topic whose methods are the functions given."""

    group_id = "g"
    consumes = (topics.REQUESTS,)

    def __init__(self, on_record, **methods):
        self.on_record = on_record
        self.__dict__.update(methods)


async def _serve_until(bus, handler, until, **methods):
    stop = asyncio.Event()
    task = asyncio.create_task(serve(bus, _Requests(handler, **methods), prefix=PREFIX, stop=stop))
    await until()
    stop.set()
    await task


def test_a_batch_is_committed_only_after_its_handler_succeeded():
    async def main():
        bus = MemoryBus()
        for request_id in ("a", "b"):
            await bus.send(REQUESTS, abort(request_id))
        handled, blocked = [], asyncio.Event()

        async def stuck(message, record):  # the service dies while handling the batch
            handled.append(message.request_id)
            await blocked.wait()
            return []

        crashed = asyncio.create_task(serve(bus, _Requests(stuck), prefix=PREFIX, stop=asyncio.Event()))
        while not handled:
            await asyncio.sleep(0.01)
        crashed.cancel()
        again = []

        async def until_two():
            while len(again) < 2:
                await asyncio.sleep(0.01)

        await _serve_until(bus, lambda m, r: again.append(m.request_id) or [], until_two)
        assert again == ["a", "b"]  # redelivered to the group's next consumer
        rest = []
        await _serve_until(bus, lambda m, r: rest.append(m) or [], lambda: asyncio.sleep(0.2))
        assert rest == []  # committed: not delivered a third time

    asyncio.run(main())


def test_commits_come_once_an_interval_however_the_polls_alternate():
    """A poll that comes back empty between two records (every step of the step loop) does not
    commit by itself: at most one commit an interval, and everything is committed at the stop."""

    class CountingBus(MemoryBus):
        commits = 0

        async def consumer(self, *args, **kwargs):
            consumer = await super().consumer(*args, **kwargs)
            commit = consumer.commit

            async def counted(offsets):
                self.commits += 1
                await commit(offsets)

            consumer.commit = counted
            return consumer

    async def main():
        bus, seen = CountingBus(), []

        async def feed():  # 30 records 15 ms apart, for 5 ms polls: empty polls between them
            for i in range(30):
                await bus.send(REQUESTS, abort(f"r{i}"))
                await asyncio.sleep(0.015)
            while len(seen) < 30:
                await asyncio.sleep(0.01)

        loop = asyncio.get_running_loop()
        started = loop.time()
        await _serve_until(bus, lambda m, r: seen.append(m) or [], feed, poll_ms=5)
        return bus, loop.time() - started

    bus, took_s = asyncio.run(main())
    assert bus.offsets["g"][REQUESTS] == 30
    assert 2 <= bus.commits <= took_s / COMMIT_INTERVAL_S + 2  # (one at the stop)


def test_undecodable_records_and_failing_handlers_go_to_the_dead_letter_topic():
    async def main():
        bus = MemoryBus()
        await bus.send(REQUESTS, b"\xc1 junk")
        await bus.send(REQUESTS, abort("boom"))
        await bus.send(REQUESTS, abort("fine"))
        seen = []

        def handler(message, record):
            if message.request_id == "boom":
                raise RuntimeError("handler bug")
            seen.append(message.request_id)
            return []

        async def until_fine():
            while not seen:
                await asyncio.sleep(0.01)

        await _serve_until(bus, handler, until_fine)
        letters = bus.topics[DEAD]
        assert [r.value for r in letters] == [b"\xc1 junk", abort("boom")]
        assert b"handler bug" in letters[1].header("parkade-error")
        assert seen == ["fine"]  # the records behind them are not held up

    asyncio.run(main())


def test_a_record_the_broker_refuses_is_answered_for_and_the_loop_goes_on():
    from parkade.services.bus.base import Outgoing
    from parkade.services.bus.serve import rejected_letter

    TOKENS = topics.topic_name(topics.TOKENS, PREFIX)

    async def main():
        bus = MemoryBus(max_record_bytes=200)
        for request_id in ("big", "small", "default"):
            await bus.send(REQUESTS, abort(request_id))
        answered = []

        def handler(message, record):
            size = {"big": 500, "small": 10, "default": 300}[message.request_id]
            return [Outgoing(topics.TOKENS, b"x" * size, message.request_id)]

        def on_send_error(out, error):
            answered.append((out.key, str(error)))
            if out.key == "default":
                return [rejected_letter(out, error)]  # what serve answers without a handler
            return [Outgoing(topics.TOKENS, b"too large", out.key), Outgoing(topics.TOKENS, b"y" * 999, "z")]

        async def until_all():
            while len(bus.topics.get(TOKENS, [])) < 2 or not bus.topics.get(DEAD):
                await asyncio.sleep(0.01)

        await _serve_until(bus, handler, until_all, on_send_error=on_send_error)
        assert [r.value for r in bus.topics[TOKENS]] == [b"x" * 10, b"too large"]  # one batch, then answers
        assert [k for k, _ in answered] == ["big", "default"]  # an answer refused too is only logged
        (letter,) = bus.topics[DEAD]
        assert letter.value == b"" and letter.key == b"default"
        assert letter.header("parkade-topic") == topics.TOKENS.encode()
        assert b"300 bytes, over 200" in letter.header("parkade-error")

    asyncio.run(main())


def test_a_refused_batch_record_is_answered_for_as_each_of_the_records_it_merged():
    from parkade.schemas import TokenEvent
    from parkade.services.bus import replies
    from parkade.services.bus.base import Outgoing

    reply = "t.tokens.0123456789ab"
    headers = ((topics.REPLY_TOPIC, reply.encode()), (topics.REPLY_BATCHES, b"1"))

    async def main():
        bus = MemoryBus(max_record_bytes=120)
        await bus.send(REQUESTS, abort("step"))
        answered = []

        def handler(message, record):
            events = [TokenEvent(request_id=f"r{i}", index=0, text="x" * 40) for i in range(3)]
            return [Outgoing(topics.TOKENS, e, reply, headers, reply) for e in events]

        def on_send_error(out, error):
            answered.append(out.message.request_id)
            return []

        async def until_answered():
            while len(answered) < 3:
                await asyncio.sleep(0.01)

        await _serve_until(
            bus, handler, until_answered, coalesce=replies.batch_events, on_send_error=on_send_error
        )
        assert answered == ["r0", "r1", "r2"] and not bus.topics.get(reply)

    asyncio.run(main())


def test_readers_off_the_step_loop_wait_longer_for_a_fetch_while_busy(monkeypatch):
    """The step loop's services fetch with the short busy wait; the tokenizer and each client,
    whose readers nothing waits on, with the longer one; all with the default while idle."""
    from parkade.client import Client
    from parkade.services.bus import memory
    from parkade.services.bus.serve import BUSY_FETCH_WAIT_MS, STREAM_FETCH_WAIT_MS
    from parkade.services.scheduler.handler import SchedulerHandler
    from parkade.services.tokenizer.handler import TokenizerHandler

    waits = []
    monkeypatch.setattr(memory.MemoryConsumer, "set_fetch_wait", lambda self, ms: waits.append(ms))
    assert SchedulerHandler.busy_fetch_wait_ms == BUSY_FETCH_WAIT_MS < STREAM_FETCH_WAIT_MS
    assert TokenizerHandler.busy_fetch_wait_ms == STREAM_FETCH_WAIT_MS

    async def main():
        bus = MemoryBus()
        busy = [True]
        service = _Requests(lambda m, r: [], busy=lambda: busy[0], busy_fetch_wait_ms=7)

        async def until_idle_again():
            while waits != [7]:
                await asyncio.sleep(0.01)
            busy[0] = False
            while waits != [7, None]:
                await asyncio.sleep(0.01)

        stop = asyncio.Event()
        task = asyncio.create_task(serve(bus, service, prefix=PREFIX, stop=stop))
        await asyncio.wait_for(until_idle_again(), 5)
        stop.set()
        await task
        waits.clear()
        async with Client(bus=bus, topic_prefix=PREFIX) as client:
            await client.submit(prompt="Hi", request_id="r")  # an open stream: busy
            while not waits:
                await asyncio.sleep(0.01)
        assert waits[0] == STREAM_FETCH_WAIT_MS

    asyncio.run(main())


def test_a_second_instance_of_a_service_is_refused_and_a_dead_one_is_not_in_the_way():
    from parkade.services.bus.instances import DuplicateInstanceError, single_instance

    fast = dict(heartbeat_s=0.02, claim_wait_s=0.15)

    async def main():
        bus = MemoryBus()
        async with single_instance(bus, "scheduler", "t.", "first", **fast):
            with pytest.raises(DuplicateInstanceError, match=r"another scheduler is serving the topics t\."):
                async with single_instance(bus, "scheduler", "t.", "second", **fast):
                    pass
            async with single_instance(bus, "executor", "t.", "other", **fast):  # another service
                pass
            async with single_instance(bus, "scheduler", "u.", "elsewhere", **fast):  # other topics
                pass
        # The first one has stopped (or died): its heartbeats stopped with it.
        async with single_instance(bus, "scheduler", "t.", "restarted", **fast):
            pass

    asyncio.run(main())


def test_a_send_to_a_reply_topic_that_is_gone_is_refused_not_fatal(monkeypatch):
    """On a Kafka that does not create topics on their first record, a late event for a client
    whose reply topic is gone waits on metadata until the send's timeout: refused (the handler
    ends that stream), never the service's end; and refused at once for a while after."""
    from aiokafka.errors import KafkaTimeoutError

    from parkade.services.bus import kafka
    from parkade.services.bus.base import OutgoingRecord, RecordRejected

    sends: list[str] = []

    class NoSuchTopicProducer:
        async def send(self, topic, value, key=None, headers=None):
            sends.append(topic)
            raise KafkaTimeoutError("no metadata")

    async def main():
        bus = kafka.KafkaBus("127.0.0.1:1")
        bus._producer = NoSuchTopicProducer()
        reply = OutgoingRecord("p.tokens.0123456789ab", b"v", reply=True)
        first = await (await bus.queue_many([reply]))
        again = await (await bus.queue_many([reply]))
        assert isinstance(first[0], RecordRejected) and isinstance(again[0], RecordRejected)
        assert sends == ["p.tokens.0123456789ab"]  # the second: refused without a wait
        with pytest.raises(KafkaTimeoutError):  # a topic of the pipeline's own: the broker is away
            await bus.queue_many([OutgoingRecord("p.tokens", b"v")])

    asyncio.run(main())


def test_a_hole_in_a_partitions_offsets_is_fetched_again_never_skipped(caplog):
    """Tansu can answer a fetch with a later batch and not the one before it (two producers on
    one partition): the consumer refuses what lies past the hole, fetches again from it, and
    hands out every record once, in order. A hole that lasts `GAP_WAIT_S` is passed, loudly."""
    from collections import namedtuple

    from aiokafka import TopicPartition

    from parkade.services.bus import kafka

    Message = namedtuple("Message", "topic partition offset key value headers timestamp")
    tp = TopicPartition("p.generated", 0)

    def batch(*offsets):
        return {tp: [Message(tp.topic, 0, o, None, b"%d" % o, [], 0) for o in offsets]}

    class Fetches:
        def __init__(self, answers):
            self.answers, self.seeks = list(answers), []

        async def getmany(self, timeout_ms):
            return self.answers.pop(0) if self.answers else {}

        def seek(self, partition, offset):
            self.seeks.append((partition, offset))

    now = [0.0]

    async def read(fetches, start=0):
        consumer = kafka.KafkaConsumer(fetches, None, {tp: start}, clock=lambda: now[0])
        got = []
        for _ in range(len(fetches.answers)):
            got += [r.offset for r in await consumer.getmany()]
        return got

    # 0-1, then 5-6 with 2-4 missing (refused, and fetched again from 2), then 2-6: each once.
    fetches = Fetches([batch(0, 1), batch(5, 6), batch(2, 3, 4, 5, 6), batch(7)])
    assert asyncio.run(read(fetches)) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert fetches.seeks == [(tp, 2)]
    # A hole inside one fetch's records: those before it go out, the rest come again.
    fetches = Fetches([batch(3, 4, 8, 9), batch(5, 6, 7, 8, 9)])
    assert asyncio.run(read(fetches, start=3)) == [3, 4, 5, 6, 7, 8, 9]
    assert fetches.seeks == [(tp, 5)]

    # A hole that never fills (transaction markers of another writer, compaction): passed once
    # it lasted GAP_WAIT_S, with an error in the log.
    async def lasting():
        fetches = Fetches([])
        consumer = kafka.KafkaConsumer(fetches, None, {tp: 0}, clock=lambda: now[0])
        got = []
        for t in (0.0, 1.0, kafka.GAP_WAIT_S + 0.5):
            now[0] = t
            fetches.answers.append(batch(4, 5))
            got.append([r.offset for r in await consumer.getmany()])
        return got, fetches.seeks

    got, seeks = asyncio.run(lasting())
    assert got == [[], [], [4, 5]] and seeks == [(tp, 0), (tp, 0)]
    assert "offsets 0 to 3 never came" in caplog.text

    # A topic an operator may compact (kv-events): its holes are compaction's, read past at once.
    compacted = TopicPartition("p.kv-events", 0)
    fetches = Fetches([{compacted: [Message(compacted.topic, 0, o, None, b"", [], 0) for o in (0, 7, 9)]}])
    consumer = kafka.KafkaConsumer(fetches, None, {compacted: 0})
    assert [r.offset for r in asyncio.run(consumer.getmany())] == [0, 7, 9] and fetches.seeks == []
