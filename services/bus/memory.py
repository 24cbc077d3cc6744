"""`MemoryBus`: topics as lists in one process, with consumer groups and committed offsets.

Same semantics as the Kafka bus where services rely on them: per-topic order, a group resumes
from its last commit, and records returned but not committed are returned again to the next
consumer of the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

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
        self.positions = {t: len(bus.topics[t]) if from_end else committed.get(t, 0) for t in topics}

    def set_fetch_wait(self, ms: int | None) -> None:
        """Nothing to set: a record wakes a waiting getmany at once."""

    def highwaters(self) -> dict[str, int]:
        return {topic: len(self.bus.topics.get(topic, ())) for topic in self.topics}

    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        if not self._available():
            try:
                await asyncio.wait_for(self.bus.changed.wait(), timeout_ms / 1000)
            except TimeoutError:
                return []
        out: list[Record] = []
        for topic in self.topics:  # a deleted topic reads as empty, as on Tansu
            records = self.bus.topics.get(topic, [])[self.positions[topic] :]
            self.positions[topic] += len(records)
            out.extend(records)
        return out

    def _available(self) -> bool:
        return any(len(self.bus.topics.get(t, ())) > self.positions[t] for t in self.topics)

    async def commit(self, offsets: dict[str, int]) -> None:
        if self.group_id is not None:
            self.bus.offsets.setdefault(self.group_id, {}).update(offsets)

    async def stop(self) -> None:
        pass


class MemoryBus:
    def __init__(self, max_record_bytes: int | None = None) -> None:
        self.max_record_bytes = max_record_bytes  # a broker's size limit, for tests
        self.topics: dict[str, list[Record]] = {}
        self.offsets: dict[str, dict[str, int]] = {}  # group -> topic -> next offset
        self.progress: dict[tuple[str, str], int] = {}  # (group, topic) -> a service's own offset
        # Set when a record arrives, then replaced: each waiter waits on the event of its time.
        # NOTE: not an asyncio.Condition: a consumer cancelled while waiting on one could leave
        # its lock held (seen on Python 3.11), and every later send then waited forever.
        self.changed = asyncio.Event()

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        records = self.topics.setdefault(topic, [])
        records.append(Record(topic, value, key, tuple(headers), 0, len(records)))
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
            outcomes.append(len(self.topics[r.topic]) - 1)
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
        for group_offsets in self.offsets.values():
            for topic in gone & group_offsets.keys():
                del group_offsets[topic]
        for key in [k for k in self.progress if k[1] in gone]:
            del self.progress[key]

    async def ping(self, timeout_s: float) -> None:
        pass  # always there

    async def close(self) -> None:
        pass
