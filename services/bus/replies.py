"""Clients' reply topics: their names, the heartbeat that says their client lives, the reaper.

A client with a reply topic of its own (`<prefix>tokens.<12 hex digits>`, see client.py) deletes
it when it stops. A client that could not (killed with SIGKILL, its machine lost) leaves it
behind, and Tansu's memory mode keeps every record of it for the broker's life: the reaper
deletes such topics.

The heartbeat: while a client lives it keeps, every `HEARTBEAT_S`, the time (ms since the epoch)
as the "offset" of its reply topic in the group `<prefix>reply-topics` (a group's offsets are
where Kafka keeps small durable numbers; nothing ever reads records as that group). Deleting a
topic deletes its offsets too.

The reaper (`reap`: each client runs it once as it starts, and `parkade topics --reap`) deletes
every reply topic whose heartbeat is older than `grace_s`. A reply topic without a heartbeat (its
client is between creating it and its first heartbeat; or it predates heartbeats; or a late record
created it again after its client deleted it) is given one by the reaper: its grace starts then.

NOTE: the invariant: a reply topic is deleted only when nobody has kept its heartbeat for
`grace_s`, and a live client keeps it every HEARTBEAT_S (30 s; the grace is 300 s). So a live
client can lose its topic only if it could not reach the broker for the whole grace (its streams
have ended by then with PipelineGoneError), or if its clock is behind the reaper's by more than
the grace less one heartbeat.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from parkade.schemas import TokenEvent, TokenEventBatch, topics
from parkade.services.bus.base import Bus, Headers, Outgoing

HEARTBEAT_S = 30.0
REAP_GRACE_S = 300.0
# NOTE: the longest any admin call here may take. A commit for a topic deleted meanwhile (another
# client stopping, another reaper) is retried by aiokafka without end on Apache Kafka, which
# answers it with a retriable "unknown topic": found by review.
ADMIN_TIMEOUT_S = 10.0
_REPLY_GROUP = "reply-topics"
# The most events in one TokenEventBatch. Only events without logprobs are batched: each holds one
# step's tokens and text, so that a batch stays far below a broker's record limit (1 MB by default).
MAX_BATCH_EVENTS = 256


def new_reply_topic(prefix: str) -> str:
    """A new client's reply topic: `<prefix>tokens.<12 random hex digits>`."""
    return f"{topics.topic_name(topics.TOKENS, prefix)}.{uuid.uuid4().hex[:12]}"


def is_reply_topic(name: str, prefix: str) -> bool:
    shared = re.escape(topics.topic_name(topics.TOKENS, prefix))
    return re.fullmatch(rf"{shared}\.[0-9a-f]{{12}}", name) is not None


def heartbeat_group(prefix: str) -> str:
    return f"{prefix}{_REPLY_GROUP}"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def heartbeat(bus: Bus, prefix: str, reply_topic: str, at_ms: int | None = None) -> None:
    """Say that the client of `reply_topic` lives (at `at_ms`, default now).
    NOTE: never after the topic was deleted: on Tansu the commit would create it again."""
    beat = {reply_topic: now_ms() if at_ms is None else at_ms}
    await asyncio.wait_for(bus.save_progress_many(heartbeat_group(prefix), beat), ADMIN_TIMEOUT_S)


async def reap(
    bus: Bus,
    prefix: str,
    *,
    grace_s: float = REAP_GRACE_S,
    keep: frozenset[str] = frozenset(),
    at_ms: int | None = None,
) -> list[str]:
    """Delete the reply topics (of `prefix`, but not those in `keep`) whose heartbeat is older
    than `grace_s` at `at_ms` (default now); start the grace of those without one. -> the deleted.
    TimeoutError where the broker does not answer within ADMIN_TIMEOUT_S a call."""
    listed = await asyncio.wait_for(bus.list_topics(), ADMIN_TIMEOUT_S)
    names = [t for t in listed if is_reply_topic(t, prefix) and t not in keep]
    if not names:
        return []
    at_ms = now_ms() if at_ms is None else at_ms
    group = heartbeat_group(prefix)
    beats = await asyncio.wait_for(bus.load_progress_many(group, names), ADMIN_TIMEOUT_S)
    stale = sorted(t for t, beat in beats.items() if at_ms - beat > grace_s * 1000)
    await asyncio.wait_for(bus.delete_topics(stale), ADMIN_TIMEOUT_S)
    # Last: a topic deleted since it was listed makes this commit hang (bounded), the deletions
    # are done by then.
    unbeaten = {t: at_ms for t in names if t not in beats}
    if unbeaten:
        await asyncio.wait_for(bus.save_progress_many(group, unbeaten), ADMIN_TIMEOUT_S)
    return stale


def asks_for_batches(headers: Headers) -> bool:
    """Whether a request's headers ask for batched events (they count only with a reply topic)."""
    return any(k == topics.REPLY_BATCHES for k, _ in headers)


def reply_key(request_id: str, to: str | None, headers: Headers) -> str:
    """The key of a request's token events, `to` its reply topic (`topics.reply_topic`, None: the
    shared topic): the reply topic's name where they may be batched (one partition for all that
    goes there, so that a request's batches and single events keep their order), else the id."""
    return to if to is not None and asks_for_batches(headers) else request_id


def batch_events(outgoing: list[Outgoing]) -> list[Outgoing]:
    """`outgoing` with the token events for each reply topic that takes batches merged into
    TokenEventBatch records (see topics.REPLY_BATCHES), each where its first event was.

    NOTE: the order of each request's events holds: a batch only grows with events that come after
    everything already in it, and an event that is not batched (logprobs) closes the open batches
    of its topic, so that what follows it goes in a later record. A batch of one event is sent as
    that event's own record. Each batch record stands for its events' records (`parts`).
    """
    merged: list[Outgoing | list[Outgoing]] = []
    open_: dict[tuple[str, bytes | None], list[Outgoing]] = {}  # (topic, content type) -> its batch
    for out in outgoing:
        event, to = out.message, out.to
        if to is None or not isinstance(event, TokenEvent) or not asks_for_batches(out.headers):
            merged.append(out)
            continue
        if event.logprobs is not None or event.prompt_logprobs is not None:
            for slot in [slot for slot in open_ if slot[0] == to]:
                del open_[slot]
            merged.append(out)
            continue
        slot = (to, topics.header(out.headers, topics.CONTENT_TYPE))
        batch = open_.get(slot)
        if batch is None or len(batch) >= MAX_BATCH_EVENTS:
            batch = open_[slot] = []
            merged.append(batch)
        batch.append(out)
    return [item if isinstance(item, Outgoing) else _batch_record(item) for item in merged]


def _batch_record(parts: list[Outgoing]) -> Outgoing:
    first = parts[0]
    if len(parts) == 1:
        return first
    content_type = topics.header(first.headers, topics.CONTENT_TYPE)
    batch = TokenEventBatch(
        events=tuple(p.message for p in parts),
        traceparents=tuple(
            (topics.header(p.headers, "traceparent") or b"").decode(errors="replace") for p in parts
        ),
    )
    headers: Headers = ((topics.CONTENT_TYPE, content_type),) if content_type is not None else ()
    return Outgoing(topics.TOKENS, batch, first.to, headers, first.to, tuple(parts))
