"""`SplitBus`: the broker for every topic but a few, which stay in this process's memory.

For an engine replica that runs in one process (`parkade replica`): its scheduler and executor
exchange a record per step on the replica's step topics, and over a broker each step pays two
hops (a produce, its acknowledgement, a fetch that the broker answers when it next looks). In
memory a plan wakes the executor, and a result the scheduler, at once. Everything the other
services read (tokenized, generated, instances, kv-events) stays on the broker.

For a gateway that runs its tokenizer (`parkade gateway --with-tokenizer`): the gateway's own
requests topic, which the tokenizer reads beside the broker's, and its reply topic, where the
tokenizer writes a record per step for the gateway's streams. Each has a bus of its own (the
gateway's producer has a thread of its own), sharing one `MemoryBus`. Every other client's
requests and reply topics stay on the broker.

NOTE: the in-memory topics live and die with the process, as the executor's KV pool does. A
restarted replica starts both sides afresh: the scheduler recomputes its requests from the
generated topic, as after the loss of any executor, so nothing in them needs to outlive it; the
streams a gateway's reply topic served died with their HTTP connections. Their records go once
their readers are past them (`MemoryBus(trim=True)`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable

from parkade.services.bus.base import Bus, Consumer, Headers, Outcome, OutgoingRecord, Record
from parkade.services.bus.memory import MemoryBus, MemoryConsumer


class SplitConsumer:
    """One consumer over topics of both sides: a getmany returns what either has, and waits on
    both at once (the memory side wakes at once; the broker's side at its fetch wait)."""

    def __init__(self, local: MemoryConsumer, remote: Consumer) -> None:
        self.local, self.remote = local, remote

    def set_fetch_wait(self, ms: int | None) -> None:
        self.remote.set_fetch_wait(ms)

    def highwaters(self) -> dict[str, int]:
        return {**self.remote.highwaters(), **self.local.highwaters()}

    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        records = self.local.take() + await self.remote.getmany(timeout_ms=0)
        if records:
            return records
        waits = (
            asyncio.ensure_future(self.local.getmany(timeout_ms)),
            asyncio.ensure_future(self.remote.getmany(timeout_ms)),
        )
        try:
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in pending:
                wait.cancel()
            if pending:
                await asyncio.wait(pending)
        except asyncio.CancelledError:
            for wait in waits:
                wait.cancel()
            raise
        # NOTE: a getmany cancelled while waiting has taken nothing (both hand records out only
        # once their wait is over); one that finished as the other did keeps its records here.
        return [record for wait in waits if not wait.cancelled() for record in wait.result()]

    async def commit(self, offsets: dict[str, int]) -> None:
        local = {t: o for t, o in offsets.items() if t in self.local.positions}
        remote = {t: o for t, o in offsets.items() if t not in local}
        if remote:
            await self.remote.commit(remote)
        if local:
            await self.local.commit(local)

    async def stop(self) -> None:
        try:
            await self.remote.stop()
        finally:
            await self.local.stop()


class SplitBus:
    """`remote` (the broker) for every topic but `local_topics` (full names), which live in
    memory (see the module): in `local`, where services with buses of their own share it (a
    gateway and its tokenizer), else in one of its own."""

    def __init__(self, remote: Bus, local_topics: Iterable[str], *, local: MemoryBus | None = None) -> None:
        self.remote = remote
        self.local = local if local is not None else MemoryBus(trim=True)
        self.local_topics = frozenset(local_topics)

    def _split(self, topics: Iterable[str]) -> tuple[list[str], list[str]]:
        topics = list(topics)
        local = [t for t in topics if t in self.local_topics]
        return local, [t for t in topics if t not in self.local_topics]

    def _side(self, topic: str) -> Bus:
        return self.local if topic in self.local_topics else self.remote

    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        await self._side(topic).send(topic, value, key=key, headers=headers)

    async def queue_many(self, records: list[OutgoingRecord]) -> Awaitable[list[Outcome]]:
        local = [r.topic in self.local_topics for r in records]
        if all(local) or not any(local):
            return await self._side(records[0].topic if records else "").queue_many(records)
        # Each side keeps its own order; the order across sides is no partition's.
        pairs = list(zip(records, local, strict=True))
        here = await self.local.queue_many([r for r, is_local in pairs if is_local])
        there = await self.remote.queue_many([r for r, is_local in pairs if not is_local])

        async def merged() -> list[Outcome]:
            mine, theirs = iter(await here), iter(await there)
            return [next(mine) if is_local else next(theirs) for is_local in local]

        return merged()

    async def consumer(
        self,
        topics: list[str],
        group_id: str | None,
        *,
        from_end: bool = False,
        start: dict[str, int] | None = None,
    ) -> Consumer:
        local, remote = self._split(topics)
        if not remote:
            return await self.local.consumer(local, group_id, from_end=from_end, start=start)
        if not local:
            return await self.remote.consumer(remote, group_id, from_end=from_end, start=start)
        remote_consumer = await self.remote.consumer(remote, group_id, from_end=from_end, start=start)
        local_consumer = await self.local.consumer(local, group_id, from_end=from_end, start=start)
        return SplitConsumer(local_consumer, remote_consumer)

    async def save_progress(self, group_id: str, topic: str, offset: int) -> None:
        await self._side(topic).save_progress(group_id, topic, offset)

    async def load_progress(self, group_id: str, topic: str) -> int | None:
        return await self._side(topic).load_progress(group_id, topic)

    async def save_progress_many(self, group_id: str, offsets: dict[str, int]) -> None:
        local, remote = self._split(offsets)
        if local:
            await self.local.save_progress_many(group_id, {t: offsets[t] for t in local})
        if remote:
            await self.remote.save_progress_many(group_id, {t: offsets[t] for t in remote})

    async def load_progress_many(self, group_id: str, topics: list[str]) -> dict[str, int]:
        local, remote = self._split(topics)
        found = await self.remote.load_progress_many(group_id, remote) if remote else {}
        return {**found, **(await self.local.load_progress_many(group_id, local))}

    async def list_topics(self) -> list[str]:
        return [*await self.remote.list_topics(), *await self.local.list_topics()]

    async def delete_topics(self, topics: list[str]) -> None:
        local, remote = self._split(topics)
        await self.local.delete_topics(local)
        if remote:
            await self.remote.delete_topics(remote)

    async def create_topics(self, topics: list[str], *, single_partition: bool = True) -> None:
        local, remote = self._split(topics)
        await self.local.create_topics(local)
        if remote:
            await self.remote.create_topics(remote, single_partition=single_partition)

    async def ping(self, timeout_s: float) -> None:
        await self.remote.ping(timeout_s)

    async def close(self) -> None:
        await self.remote.close()
