"""`MemoryBus`: topics as lists in one process, with consumer groups and committed offsets.

Same semantics as the Kafka bus where services rely on them: per-topic order, a group resumes
from its last commit, and records returned but not committed are returned again to the next
consumer of the group.

It keeps every record, as Tansu does, unless made with `trim`: then a topic's records go once
every live consumer that reads it is past them: a group's consumer once its group committed past
them, one without a group once it took them (the step topics of a replica that runs in one
process, and a gateway's reply topic, see split.py: records for as long as it serves).
`bus.topics[t]` holds the records from `bus.base[t]`, the offset of its first one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable

from parkade.services.bus.base import Headers, Outcome, OutgoingRecord, Record, RecordRejected


class MemoryConsumer:
    def __init__(
        self,
        bus: MemoryBus,
        topics: list[str],
        group_id: str | None,
        from_end: bool,
        start: dict[str, int] | None = None,
    ) -> None:
        self.bus = bus
        self.topics = topics
        self.group_id = group_id
        committed = bus.offsets.get(group_id, {}) if group_id else (start or {})
        for topic in topics:
            bus.topics.setdefault(topic, [])
        # Without a commit (or a start) for a topic: its first record kept, as Kafka's earliest.
        self.positions = {t: bus.end(t) if from_end else committed.get(t, bus.base.get(t, 0)) for t in topics}
        for t, position in self.positions.items():
            if position < bus.base.get(t, 0):
                raise ValueError(f"{t}: offset {position} is trimmed (the topic starts at {bus.base[t]})")
        bus.readers.append(self)

    def set_fetch_wait(self, ms: int | None) -> None:
        """Nothing to set: a record wakes a waiting getmany at once."""

    def highwaters(self) -> dict[str, int]:
        return {topic: self.bus.end(topic) for topic in self.topics}

    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        if not self._available():
            try:
                await asyncio.wait_for(self.bus.changed.wait(), timeout_ms / 1000)
            except TimeoutError:
                return []
        return self.take()

    def take(self) -> list[Record]:
        """What is there now, without waiting."""
        out: list[Record] = []
        for topic in self.topics:  # a deleted topic reads as empty, as on Tansu
            start = self.positions[topic] - self.bus.base.get(topic, 0)
            records = self.bus.topics.get(topic, [])[start:]
            self.positions[topic] += len(records)
            out.extend(records)
        if out and self.group_id is None and self.bus.trim:
            self.bus.trim_read(self.topics)
        return out

    def _available(self) -> bool:
        return any(self.bus.end(t) > self.positions[t] for t in self.topics)

    async def commit(self, offsets: dict[str, int]) -> None:
        if self.group_id is not None:
            self.bus.offsets.setdefault(self.group_id, {}).update(offsets)
            if self.bus.trim:
                self.bus.trim_read(offsets)

    async def stop(self) -> None:
        if self in self.bus.readers:
            self.bus.readers.remove(self)


class MemoryBus:
    def __init__(self, max_record_bytes: int | None = None, *, trim: bool = False) -> None:
        self.max_record_bytes = max_record_bytes  # a broker's size limit, for tests
        self.trim = trim  # drop what every reading group committed past (see the module)
        self.topics: dict[str, list[Record]] = {}
        self.base: dict[str, int] = {}  # topic -> the offset of its first record kept (trimmed)
        self.readers: list[MemoryConsumer] = []  # the consumers not stopped
        self.offsets: dict[str, dict[str, int]] = {}  # group -> topic -> next offset
        self.progress: dict[tuple[str, str], int] = {}  # (group, topic) -> a service's own offset
        # Set when a record arrives, then replaced: each waiter waits on the event of its time.
        # NOTE: not an asyncio.Condition: a consumer cancelled while waiting on one could leave
        # its lock held (seen on Python 3.11), and every later send then waited forever.
        self.changed = asyncio.Event()

    def end(self, topic: str) -> int:
        """The offset the next record of `topic` gets."""
        return self.base.get(topic, 0) + len(self.topics.get(topic, ()))

    def trim_read(self, topics: Iterable[str]) -> None:
        """Drop the records of `topics` that every live consumer of them is past: a group's
        consumer where its group committed, one without a group where it read to. NOTE: a
        consumer that starts below what is left (an offset of its own) is refused at its start."""
        for topic in topics:
            readers = [r for r in self.readers if topic in r.positions]
            if not readers or topic not in self.topics:
                continue
            low = min(
                self.offsets.get(r.group_id, {}).get(topic, 0)
                if r.group_id is not None
                else r.positions[topic]
                for r in readers
            )
            base = self.base.get(topic, 0)
            if low > base:
                del self.topics[topic][: low - base]
                self.base[topic] = low

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        offset = self.end(topic)
        self.topics.setdefault(topic, []).append(Record(topic, value, key, tuple(headers), 0, offset))
        self.changed.set()
        self.changed = asyncio.Event()

    async def consumer(
        self,
        topics: list[str],
        group_id: str | None,
        *,
        from_end: bool = False,
        start: dict[str, int] | None = None,
    ) -> MemoryConsumer:
        return MemoryConsumer(self, topics, group_id, from_end, start)

    async def save_progress(self, group_id: str, topic: str, offset: int) -> None:
        self.progress[(group_id, topic)] = offset

    async def load_progress(self, group_id: str, topic: str) -> int | None:
        return self.progress.get((group_id, topic))

    async def save_progress_many(self, group_id: str, offsets: dict[str, int]) -> None:
        for topic, offset in offsets.items():
            self.progress[(group_id, topic)] = offset

    async def load_progress_many(self, group_id: str, topics: list[str]) -> dict[str, int]:
        return {t: self.progress[(group_id, t)] for t in topics if (group_id, t) in self.progress}

    async def queue_many(self, records: list[OutgoingRecord]) -> Awaitable[list[Outcome]]:
        outcomes: list[Outcome] = []
        for r in records:  # in memory: had at once, unless over the size limit
            if self.max_record_bytes is not None and len(r.value) > self.max_record_bytes:
                outcomes.append(RecordRejected(f"{len(r.value)} bytes, over {self.max_record_bytes}"))
                continue
            await self.send(r.topic, r.value, key=r.key, headers=r.headers)
            outcomes.append(self.end(r.topic) - 1)
        done = asyncio.get_running_loop().create_future()
        done.set_result(outcomes)
        return done

    async def create_topics(self, topics: list[str], *, single_partition: bool = True) -> None:
        for topic in topics:
            self.topics.setdefault(topic, [])

    async def list_topics(self) -> list[str]:
        return list(self.topics)

    async def delete_topics(self, topics: list[str]) -> None:
        # As a Kafka broker does: the records go, and every offset kept for the topics.
        gone = set(topics)
        for topic in gone:
            self.topics.pop(topic, None)
            self.base.pop(topic, None)
        for group_offsets in self.offsets.values():
            for topic in gone & group_offsets.keys():
                del group_offsets[topic]
        for key in [k for k in self.progress if k[1] in gone]:
            del self.progress[key]

    async def ping(self, timeout_s: float) -> None:
        pass  # always there

    async def close(self) -> None:
        pass
