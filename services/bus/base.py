"""`Bus` and `Consumer`: what a service needs from a broker, and no more.

Outgoing        a message a handler wants sent (a Struct, its unprefixed topic)
-> OutgoingRecord  the encoded record on its full topic name, handed to `Bus.send_many`
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
    """An encoded record to send; `topic` is the full (prefixed) topic name."""

    topic: str
    value: bytes
    key: bytes | None = None
    headers: Headers = ()


class CommitError(RuntimeError):
    """The offsets could not be committed (e.g. a rebalance took the partitions away)."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A record a handler wants sent: `topic` is the unprefixed name (schemas.topics); `message`
    a msgspec Struct, or raw bytes (a dead letter)."""

    topic: str
    message: Any
    key: str | None = None
    headers: Headers = ()


class Consumer(Protocol):
    async def getmany(self, timeout_ms: int = 100) -> list[Record]:
        """The next records, in offset order per partition; [] after timeout_ms without any."""
        ...

    async def commit(self) -> None:
        """Mark every record returned so far as handled (at-least-once: call after handling)."""
        ...

    async def stop(self) -> None: ...


class Bus(Protocol):
    async def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers = ()
    ) -> None:
        """Send one record; returns once the broker has it."""
        ...

    async def send_many(self, records: list[OutgoingRecord]) -> None:
        """Send records in order (per partition); returns once the broker has them all."""
        ...

    async def queue_many(self, records: list[OutgoingRecord]) -> Awaitable[None]:
        """Queue records in order (per partition) and return at once; the returned awaitable
        completes once the broker has them all, and raises if it refused one."""
        ...

    async def consumer(self, topics: list[str], group_id: str | None, *, from_end: bool = False) -> Consumer:
        """A started consumer. `group_id` None: no group, no commits (a client's private view);
        `from_end`: skip what is already in the topics."""
        ...

    async def create_topics(self, topics: list[str]) -> None:
        """Create the topics that do not exist yet."""
        ...

    async def close(self) -> None: ...
