"""`KafkaBus`: the bus on a real Kafka-protocol broker, through aiokafka.

NOTE: delivery is at-least-once: offsets are committed only after the handler's output was
acknowledged. Producers use acks=all; idempotence is optional (`idempotence`: Apache Kafka has
it, Tansu's memory mode does not), and nothing is transactional.
NOTE: one instance per service (see instances.py): the tokenizer and the scheduler keep
in-memory state that spans two topics, so each consumer takes every partition itself and uses
its group only to keep offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    BrokerResponseError,
    CommitFailedError,
    CorruptRecordException,
    IllegalStateError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
    for_code,
)

from parkade.schemas.topics import COMPACTED, base_topic
from parkade.services.bus.base import CommitError, Headers, Outcome, OutgoingRecord, Record, RecordRejected
from parkade.services.bus.loop_thread import LoopThread
from parkade.services.bus.security import client_settings

T = TypeVar("T")

log = logging.getLogger(__name__)


def _security() -> dict[str, Any]:
    """TLS and SASL settings from the environment (see security.py), read once per process."""
    global _SECURITY
    if _SECURITY is None:
        _SECURITY = client_settings(os.environ)
    return _SECURITY


_SECURITY: dict[str, Any] | None = None

# Latency matters more than batching: a step plan waits on every hop.
IDLE_FETCH_WAIT_MS = 20  # see Consumer.set_fetch_wait
_CONSUMER_SETTINGS = dict(
    fetch_max_wait_ms=IDLE_FETCH_WAIT_MS, enable_auto_commit=False, auto_offset_reset="earliest"
)


# A partition's batch, at most. aiokafka sends one produce request to a broker at a time, and a
# record that finds its partition's batch full waits for that batch to go (its default: 16 KiB,
# about ten tokenized requests). Under a burst of 64 requests the gateway's and the tokenizer's
# records went out ten at a time, one round trip each, and some waited 120-430 ms behind records
# sent after them. A batch is one record batch to the broker, which refuses one larger than its
# message.max.bytes (about 1 MB by default, on Kafka and Tansu) with every record in it: a broker
# set below 512 KiB needs a larger limit. A record larger than this still goes, in a batch alone
# (aiokafka's max_request_size, 1 MiB, caps a record).
MAX_BATCH_BYTES = 512 * 2**10

# Errors that are one record's own (its size, its bytes): the others (the broker is away, a
# timeout) fail every record alike and end the service, whose records are then read again.
_RECORD_ERRORS = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    CorruptRecordException,
)


async def _completed(value: object) -> object:
    return value


async def _on(thread: LoopThread | None, coro: Coroutine[Any, Any, T]) -> T:
    """`coro` run where the producer lives: `thread`'s loop, or the caller's (None)."""
    return await (coro if thread is None else thread.run(coro))


# What a send to a client's reply topic meets once the topic is gone, on a broker that does not
# create topics on their first record (Kafka with auto.create.topics.enable=false: MSK's default):
# no metadata for it until the send's timeout, or the broker's answer that it has no such topic.
_GONE_ERRORS = (KafkaTimeoutError, UnknownTopicOrPartitionError, TimeoutError)
# How long a hole in a partition's offsets is fetched again before it is passed (KafkaConsumer).
GAP_WAIT_S = 5.0
REPLY_METADATA_S = 5.0  # the longest wait for a reply topic's metadata
GONE_FOR_S = 60.0  # a reply topic found gone is refused at once for this long


async def _outcomes(acks: list[Awaitable[object]], records: list[OutgoingRecord]) -> list[Outcome]:
    outcomes: list[Outcome] = []
    results = await asyncio.gather(*acks, return_exceptions=True)
    for result, record in zip(results, records, strict=True):
        topic = record.topic
        if isinstance(result, RecordRejected):
            outcomes.append(result)
        elif isinstance(result, _RECORD_ERRORS) or (record.reply and isinstance(result, _GONE_ERRORS)):
            outcomes.append(RecordRejected(f"{type(result).__name__}: {result}"))
        elif isinstance(result, BaseException):
            result.add_note(f"sending a record to {topic}")
            raise result
        else:
            outcomes.append(result.offset)  # RecordMetadata
    return outcomes


class TopicLayoutError(ValueError):
    """A topic exists with a layout the services cannot work with (more than one partition)."""


class KafkaConsumer:
    """One consumer over its assigned partitions, that never skips a record the log holds.

    NOTE: Tansu (0.6, memory mode) can answer a fetch that runs while two producers append to
    the same partition with the later batch and not the one before it (measured: two producers,
    one reader tailing the partition, 1 to 5 batches of 18,000 records skipped; a second read
    from 0 finds them all). aiokafka moves its position past such a hole without a word, and a
    skipped record is a lost token (two schedulers share the generated topic, two tokenizers a
    reply topic). So each partition's next offset is tracked: a record past it is refused, and
    the partition is fetched again from that offset, where the missing batch is found. Our
    topics are not transactional and, but for `COMPACTED`, not compacted: their offsets
    are dense. A hole that is still there after `GAP_WAIT_S` (another writer's transaction
    markers) is passed, with an error in the log. A compacted topic is not checked: its holes
    are compaction's, and a kv-events record missed costs a routing guess until the next
    snapshot, never a token.
    """

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        group_id: str | None,
        positions: dict[TopicPartition, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self._group_id = group_id
        self._next: dict[TopicPartition, int] = dict(positions or {})  # the next offset to hand out
        self._gaps: dict[TopicPartition, tuple[int, float]] = {}  # a hole: (its start, first seen)
        self._clock = clock

    @staticmethod
    def _dense(tp: TopicPartition) -> bool:
        return base_topic(tp.topic) not in COMPACTED

    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        batches = await self._consumer.getmany(timeout_ms=timeout_ms)
        out: list[Record] = []
        for tp, records in batches.items():
            for m in records:
                expected = self._next.get(tp, m.offset)
                if m.offset < expected:
                    continue  # fetched again after a seek back: handed out already
                if m.offset > expected and self._dense(tp) and not self._gap_passed(tp, expected, m.offset):
                    self._consumer.seek(tp, expected)  # the rest of this batch comes again
                    break
                self._next[tp] = m.offset + 1
                headers = tuple(m.headers or ())
                out.append(Record(m.topic, m.value, m.key, headers, m.partition, m.offset, m.timestamp))
        return out

    def _gap_passed(self, tp: TopicPartition, expected: int, offset: int) -> bool:
        """Whether to go on past the hole [expected, offset) of `tp`: only once it lasted."""
        now = self._clock()
        start, since = self._gaps.get(tp, (expected, now))
        if start != expected:
            since = now  # another hole
        self._gaps[tp] = (expected, since)
        if now - since < GAP_WAIT_S:
            return False
        del self._gaps[tp]
        log.error(
            "%s[%d]: offsets %d to %d never came (fetched again for %.1f s); going on past them",
            tp.topic, tp.partition, expected, offset - 1, now - since,
        )  # fmt: skip
        return True

    def set_fetch_wait(self, ms: int | None) -> None:
        # NOTE: aiokafka (0.14) reads its fetcher's wait anew for every fetch request, and has no
        # public setter: a newer aiokafka without the attribute keeps its wait (slower, correct).
        fetcher = getattr(self._consumer, "_fetcher", None)
        if fetcher is not None and hasattr(fetcher, "_fetch_max_wait_ms"):
            fetcher._fetch_max_wait_ms = IDLE_FETCH_WAIT_MS if ms is None else ms

    def highwaters(self) -> dict[str, int]:
        out = {}
        for partition in self._consumer.assignment():
            highwater = self._consumer.highwater(partition)
            if highwater is not None:
                out[partition.topic] = out.get(partition.topic, 0) + highwater
        return out

    async def commit(self, offsets: dict[str, int]) -> None:
        if self._group_id is not None and offsets:
            try:
                await self._consumer.commit({TopicPartition(t, 0): o for t, o in offsets.items()})
            except (CommitFailedError, IllegalStateError, KafkaError) as error:
                # e.g. a member that joined the group by hand: the group refuses commits from
                # outside it until that member leaves.
                raise CommitError(str(error)) from error

    async def stop(self) -> None:
        await self._consumer.stop()


class KafkaBus:
    def __init__(
        self,
        bootstrap_servers: str,
        client_id: str = "parkade",
        *,
        idempotence: bool = False,
        producer_thread: bool = False,
    ) -> None:
        """`idempotence`: the producer's, so that a retried send is never written twice; Apache
        Kafka has it, Tansu's memory mode does not (its producers fail at their first send).
        `producer_thread`: the producer runs on a loop of its own (see loop_thread.py), for a
        caller whose loop runs long iterations of other work (the gateway's HTTP)."""
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        self.idempotence = idempotence
        self._producer: AIOKafkaProducer | None = None
        self._producer_thread = producer_thread
        self._loop_thread: LoopThread | None = None  # started with the producer
        self._gone: dict[str, float] = {}  # reply topics found gone -> until when (loop time)
        self._producer_lock = asyncio.Lock()
        self._progress: dict[tuple[str, str], AIOKafkaConsumer] = {}

    async def _started_producer(self) -> tuple[AIOKafkaProducer, LoopThread | None]:
        """The producer, and the thread whose loop it lives on (None: this loop). Read together:
        a `close` meanwhile may clear the bus's references, never the pair handed out."""
        if self._producer is not None:
            return self._producer, self._loop_thread
        # NOTE: locked: concurrent first sends (a gateway's burst) would each start a producer.
        async with self._producer_lock:
            if self._producer is None:
                if self._producer_thread and self._loop_thread is None:
                    self._loop_thread = LoopThread(f"{self.client_id}-producer")
                self._producer = await _on(self._loop_thread, self._new_producer())
        return self._producer, self._loop_thread

    async def _new_producer(self) -> AIOKafkaProducer:
        # acks="all": a record counts as sent once every in-sync replica has it, so that a
        # leader's failover cannot lose what was acknowledged (and then committed past).
        producer = AIOKafkaProducer(  # aiokafka binds it to the loop it is made on
            **_security(),
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            linger_ms=0,
            max_batch_size=MAX_BATCH_BYTES,
            enable_idempotence=self.idempotence,
            acks="all",
        )
        await producer.start()
        return producer

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        producer, thread = await self._started_producer()
        await _on(thread, producer.send_and_wait(topic, value, key=key, headers=list(headers)))

    async def consumer(
        self,
        topics: list[str],
        group_id: str | None,
        *,
        from_end: bool = False,
        start: dict[str, int] | None = None,
    ) -> KafkaConsumer:
        consumer = AIOKafkaConsumer(
            **_security(),
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            group_id=group_id,
            **_CONSUMER_SETTINGS,
        )
        await consumer.start()
        # Every partition assigned directly, never by joining the group: one instance per service
        # (see instances.py) owns all of them, and a group's membership only costs time. A
        # member killed with SIGKILL stays in the group until it times out, and its successor
        # waited that long (18 s on Tansu) for its partitions; the first join alone took 5 s.
        # The group id still names where the offsets are committed and read back from.
        partitions = [
            TopicPartition(topic, p)
            for topic in topics
            for p in (consumer.partitions_for_topic(topic) or {0})
        ]
        consumer.assign(partitions)
        if from_end:
            await consumer.seek_to_end(*partitions)
        for tp in partitions:
            if start and tp.topic in start:
                consumer.seek(tp, start[tp.topic])
            elif group_id is not None:
                committed = await consumer.committed(tp)
                if committed is None:
                    await consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, committed)
        # Resolved now, so that nothing sent after this is missed; and the start of each
        # partition's offset check (see KafkaConsumer).
        positions = {tp: await consumer.position(tp) for tp in partitions}
        return KafkaConsumer(consumer, group_id, positions)

    async def queue_many(self, records: list[OutgoingRecord]) -> Awaitable[list[Outcome]]:
        # Queue them all, then wait: one round trip for the batch rather than one per record.
        # The producer keeps the order within a partition.
        producer, thread = await self._started_producer()
        acks = await _on(thread, self._queue(producer, records))
        if thread is None:
            return _outcomes(acks, records)
        # Awaited on the producer's loop from now, not once the caller awaits it.
        return thread.submit(_outcomes(acks, records))

    async def _queue(
        self, producer: AIOKafkaProducer, records: list[OutgoingRecord]
    ) -> list[Awaitable[object]]:
        """Hand `records` to the producer, in order; -> their acknowledgements (on its loop)."""
        acks: list[Awaitable[object]] = []
        now = asyncio.get_running_loop().time()
        for r in records:
            if r.reply and self._gone.get(r.topic, 0.0) > now:
                acks.append(_completed(RecordRejected(f"the reply topic {r.topic} is gone")))
                continue
            try:
                send = producer.send(r.topic, r.value, key=r.key, headers=list(r.headers))
                # A reply topic may be gone: its metadata is not waited for as long as a send's.
                acks.append(await (asyncio.wait_for(send, REPLY_METADATA_S) if r.reply else send))
            except _RECORD_ERRORS as error:  # the producer's own size check
                acks.append(_completed(error))
            except _GONE_ERRORS as error:
                if not r.reply:
                    raise
                self._gone_now(r.topic, now)
                acks.append(_completed(RecordRejected(f"the reply topic {r.topic} is gone: {error!r}")))
        return acks

    def _gone_now(self, topic: str, now: float) -> None:
        if len(self._gone) > 10_000:  # bounded: the expired go first
            self._gone = {t: until for t, until in self._gone.items() if until > now}
        self._gone[topic] = now + GONE_FOR_S

    async def create_topics(self, topics: list[str], *, single_partition: bool = True) -> None:
        """Create missing topics with one partition each, and (`single_partition`) refuse existing
        ones with more.

        NOTE: one partition is what gives the services their order: step results in step order,
        and a request's records in the order they were sent across the topics it crosses.
        """
        admin = AIOKafkaAdminClient(
            **_security(), bootstrap_servers=self.bootstrap_servers, client_id=self.client_id
        )
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            missing = [
                NewTopic(t, num_partitions=1, replication_factor=1) for t in topics if t not in existing
            ]
            if missing:
                with contextlib.suppress(TopicAlreadyExistsError):
                    await admin.create_topics(missing)
            for described in await admin.describe_topics(topics) if single_partition else ():
                num_partitions = len(described.get("partitions") or ())
                if num_partitions > 1:
                    raise TopicLayoutError(
                        f"topic {described['topic']} has {num_partitions} partitions; Parkade needs 1"
                    )
        finally:
            await admin.close()

    async def save_progress(self, group_id: str, topic: str, offset: int) -> None:
        consumer = await self._progress_consumer(group_id, topic)
        await consumer.commit({TopicPartition(topic, 0): offset})

    async def load_progress(self, group_id: str, topic: str) -> int | None:
        consumer = await self._progress_consumer(group_id, topic)
        return await consumer.committed(TopicPartition(topic, 0))

    async def _progress_consumer(self, group_id: str, topic: str) -> AIOKafkaConsumer:
        """`group_id`'s committer of `topic`, kept (a group's offsets are where Kafka keeps small
        durable numbers)."""
        consumer = self._progress.get((group_id, topic))
        if consumer is None:
            consumer = self._progress[(group_id, topic)] = await self._committer(group_id, [topic])
        return consumer

    async def _committer(self, group_id: str, topics: list[str]) -> AIOKafkaConsumer:
        """A started consumer of `group_id`, assigned `topics` by hand and paused: it only
        commits (a fetch of the topics would read their records for nothing)."""
        consumer = AIOKafkaConsumer(
            **_security(),
            bootstrap_servers=self.bootstrap_servers,
            client_id=self.client_id,
            group_id=group_id,
            enable_auto_commit=False,
        )
        await consumer.start()
        partitions = [TopicPartition(topic, 0) for topic in topics]
        consumer.assign(partitions)
        consumer.pause(*partitions)
        return consumer

    async def save_progress_many(self, group_id: str, offsets: dict[str, int]) -> None:
        if not offsets:
            return
        consumer = await self._committer(group_id, list(offsets))
        try:
            await consumer.commit({TopicPartition(t, 0): o for t, o in offsets.items()})
        finally:
            await consumer.stop()

    async def load_progress_many(self, group_id: str, topics: list[str]) -> dict[str, int]:
        async with self._admin() as admin:
            try:
                return await _committed(admin, group_id, topics)
            except BrokerResponseError:  # one topic's error fails the batch: ask for each alone
                out: dict[str, int] = {}
                for topic in topics:
                    with contextlib.suppress(BrokerResponseError):
                        out.update(await _committed(admin, group_id, [topic]))
                return out

    async def list_topics(self) -> list[str]:
        async with self._admin() as admin:
            return list(await admin.list_topics())

    async def delete_topics(self, topics: list[str]) -> None:
        if not topics:
            return
        async with self._admin() as admin:
            response = await admin.delete_topics(topics)
        for topic, code in response.topic_error_codes:
            if code not in (0, UnknownTopicOrPartitionError.errno):  # missing already: done
                raise for_code(code)(f"deleting topic {topic}")

    @contextlib.asynccontextmanager
    async def _admin(self) -> AsyncIterator[AIOKafkaAdminClient]:
        admin = AIOKafkaAdminClient(
            **_security(), bootstrap_servers=self.bootstrap_servers, client_id=self.client_id
        )
        try:
            await admin.start()
            yield admin
        finally:
            await admin.close()

    async def ping(self, timeout_s: float) -> None:
        await wait_for_broker(self.bootstrap_servers, timeout_s=timeout_s)

    async def close(self) -> None:
        for consumer in self._progress.values():
            await consumer.stop()
        self._progress.clear()
        # Locked: a first send's producer is not being made meanwhile.
        async with self._producer_lock:
            producer, thread = self._producer, self._loop_thread
            self._producer, self._loop_thread = None, None
            try:
                if producer is not None:
                    await _on(thread, producer.stop())
            finally:  # even when the stop failed or was cancelled (a bounded close)
                if thread is not None:
                    thread.close()


async def _committed(admin: AIOKafkaAdminClient, group_id: str, topics: list[str]) -> dict[str, int]:
    # NOTE: partitions named: Tansu 0.6's answer to "every offset of the group" is one aiokafka
    # cannot decode (it drops the connection).
    partitions = [TopicPartition(topic, 0) for topic in topics]
    offsets = await admin.list_consumer_group_offsets(group_id, partitions=partitions)
    return {tp.topic: kept.offset for tp, kept in offsets.items() if kept.offset >= 0}


class BrokerUnreachableError(ConnectionError):
    """No broker answered at the bootstrap servers in time."""


async def wait_for_broker(bootstrap_servers: str, timeout_s: float = 30.0) -> None:
    """Return once the broker answers metadata requests; BrokerUnreachableError after `timeout_s`.

    aiokafka's log lines about each failed attempt are silenced meanwhile: failing is what is
    expected here, and the error says it once."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    aiokafka_log = logging.getLogger("aiokafka")
    level = aiokafka_log.level
    aiokafka_log.setLevel(logging.CRITICAL)
    try:
        while True:
            admin = AIOKafkaAdminClient(
                **_security(), bootstrap_servers=bootstrap_servers, request_timeout_ms=2000
            )
            try:
                await admin.start()
                await admin.list_topics()
                return
            except (KafkaConnectionError, OSError) as error:
                if asyncio.get_running_loop().time() > deadline:
                    raise BrokerUnreachableError(f"nothing answered within {timeout_s:g} s") from error
                await asyncio.sleep(0.1)
            finally:
                with contextlib.suppress(Exception):
                    await admin.close()
    finally:
        aiokafka_log.setLevel(level)
