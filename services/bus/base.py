"""`Bus` and `Consumer`: what a service needs from a broker, and no more.

Outgoing        a message a handler wants sent (a Struct, its unprefixed topic)
-> OutgoingRecord  the encoded record on its full topic name, handed to `Bus.queue_many`
Record          a record read back by a `Consumer`, with its partition and offset
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol

Headers = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Record:
    """A record read from a topic."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: Headers = ()
    partition: int = 0
    offset: int = 0
    timestamp_ms: int = -1  # the record's Kafka timestamp (producer or broker time); -1: none

    def header(self, name: str) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)


@dataclass(frozen=True, slots=True)
class OutgoingRecord:
    """An encoded record to send; `topic` is the full (prefixed) topic name. `reply`: a client's
    reply topic, which may be gone (its client deleted it, or the reaper did): a send that finds
    no such topic is refused (`RecordRejected`) rather than failing the service."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: Headers = ()
    reply: bool = False


class RecordRejected(Exception):
    """The broker (or the producer, before it) refused this one record for what it is, too
    large or malformed: sending it again would fail the same way."""


# What became of one record sent: its offset in its topic, or why the broker refused it.
Outcome = int | RecordRejected


class CommitError(RuntimeError):
    """The offsets could not be committed (e.g. a member that joined the group by hand makes the
    broker refuse commits from outside the group until it leaves)."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A record a handler wants sent: `topic` is the unprefixed name (schemas.topics); `message`
    a msgspec Struct, or raw bytes (a dead letter); `to`, a full topic name sent to instead of
    `topic`'s (a client's reply topic); `parts`, the records it stands for when it merges several
    (a TokenEventBatch): sent or refused, it is answered for as each of them."""

    topic: str
    message: Any
    key: str | None = None
    headers: Headers = ()
    to: str | None = None
    parts: tuple[Outgoing, ...] = ()


class Consumer(Protocol):
    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        """The next records, in offset order per partition; [] after timeout_ms without any."""
        ...

    def set_fetch_wait(self, ms: int | None) -> None:
        """How long the broker may hold a fetch that finds no new record (None: the default).
        NOTE: Tansu answers a lone waiting fetch as soon as a record arrives, but not reliably
        otherwise: many fetches then wait out their time (measured: one consumer of one
        partition, 100 of 100 records in about 2 ms at a 200 ms wait; one consumer of four
        partitions, 42 of 100 took the full 200 ms; three consumers of one partition each at
        500 ms, 277 of 300 took over 20 ms, median 131 ms). Apache Kafka answers at once. Every
        pipeline has several fetches waiting, so a short wait is what a consumer on a
        latency-bound path needs, at the price of a fetch every few ms while nothing comes."""
        ...

    def highwaters(self) -> dict[str, int]:
        """The end offset of each topic read, as last heard from the broker (no round trip):
        for the consumer-lag metric. A topic not heard of yet is missing."""
        ...

    async def commit(self, offsets: dict[str, int]) -> None:
        """Store the group's offsets: topic (full name; partition 0) -> the next offset to read
        after a restart. At-least-once: never past a record that is not handled yet."""
        ...

    async def stop(self) -> None: ...


class Bus(Protocol):
    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        """Send one record; returns once the broker has it."""
        ...

    async def queue_many(self, records: list[OutgoingRecord]) -> Awaitable[list[Outcome]]:
        """Queue records in order (per partition) and return at once. The returned awaitable
        completes once the broker has them all, with one entry per record: its offset, or the
        `RecordRejected` of a record refused for what it is (too large); it raises for any other
        failure (the broker is away), after which nothing later may be sent."""
        ...

    async def consumer(
        self,
        topics: list[str],
        group_id: str | None,
        *,
        from_end: bool = False,
        start: dict[str, int] | None = None,
    ) -> Consumer:
        """A started consumer of every partition of `topics`, from `group_id`'s committed offsets
        (the earliest where none); it never joins the group (one instance per service). `group_id`
        None: no commits (a client's private view);
        `from_end`: skip what is already in the topics; `start`: (no group) from these offsets."""
        ...

    async def save_progress(self, group_id: str, topic: str, offset: int) -> None:
        """Keep one offset under (group, topic), for a service's own bookkeeping (where to read a
        topic it writes from, after a restart): the group never consumes that topic."""
        ...

    async def load_progress(self, group_id: str, topic: str) -> int | None:
        """The offset kept by `save_progress`; None if none was."""
        ...

    async def save_progress_many(self, group_id: str, offsets: dict[str, int]) -> None:
        """`save_progress` for many topics at once (one round trip on Kafka)."""
        ...

    async def load_progress_many(self, group_id: str, topics: list[str]) -> dict[str, int]:
        """`load_progress` for many topics at once; a topic with none kept is left out."""
        ...

    async def list_topics(self) -> list[str]:
        """The name of every topic on the broker."""
        ...

    async def delete_topics(self, topics: list[str]) -> None:
        """Delete these topics, their records and the offsets kept for them; one that does not
        exist is no error. NOTE: stop the topic's consumers first; and on Tansu (0.6, measured) a
        record sent to, or an offset committed for, a missing topic creates it again."""
        ...

    async def create_topics(self, topics: list[str], *, single_partition: bool = True) -> None:
        """Create the topics that do not exist yet; with `single_partition`, refuse existing ones
        with more than one partition (TopicLayoutError)."""
        ...

    async def ping(self, timeout_s: float) -> None:
        """Return once the broker answers; raise ConnectionError if it does not within `timeout_s`."""
        ...

    async def close(self) -> None: ...
