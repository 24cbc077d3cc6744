"""Clients' reply topics on the in-memory bus: a client deletes its own when it stops, keeps a
heartbeat for it while it lives, and the reaper deletes those of clients gone for longer than the
grace, never a live client's (see services/bus/replies.py); the events sent there in batches keep
each request's order."""

from __future__ import annotations

import asyncio
import time

import pytest

from parkade.client import Client
from parkade.schemas import TokenEvent, TokenEventBatch, TokenLogprobs, topics
from parkade.services.bus import MemoryBus, replies
from parkade.services.bus import client as client_module
from parkade.services.bus.base import Outgoing

PREFIX = "t."


def reply_topics(bus):
    return sorted(t for t in bus.topics if replies.is_reply_topic(t, PREFIX))


def test_names_that_are_reply_topics():
    name = replies.new_reply_topic(PREFIX)
    assert name.startswith("t.tokens.") and replies.is_reply_topic(name, PREFIX)
    assert not replies.is_reply_topic("t.tokens", PREFIX)  # the shared topic
    assert not replies.is_reply_topic(name, "u.") and not replies.is_reply_topic(name + "0", PREFIX)
    assert not replies.is_reply_topic("t.tokensX0123456789ab", PREFIX)


def test_a_client_takes_a_reply_topic_named_for_it_only_if_it_is_one():
    name = replies.new_reply_topic(PREFIX)
    bus = MemoryBus()
    assert client_module.RequestClient(bus, PREFIX, reply_topic=name).reply_topic == name
    for wrong in ("t.tokens", replies.new_reply_topic("u."), "t.requests"):
        with pytest.raises(ValueError, match="is not a reply topic"):
            client_module.RequestClient(bus, PREFIX, reply_topic=wrong)
    with pytest.raises(ValueError, match="is not a reply topic"):  # it reads the shared topic then
        client_module.RequestClient(bus, PREFIX, reply_topic=name, own_reply_topic=False)


def test_a_clients_reply_topic_is_deleted_when_it_stops():
    async def main():
        bus = MemoryBus()
        async with Client(bus=bus, topic_prefix=PREFIX) as client:
            await asyncio.sleep(0.05)  # its heartbeat is kept
            assert reply_topics(bus) == [client.reply_topic]
            assert (replies.heartbeat_group(PREFIX), client.reply_topic) in bus.progress
        assert reply_topics(bus) == [] and bus.progress == {}
        await client.stop()  # a second stop: nothing to do, nothing raised

    asyncio.run(main())


def killed(client):
    """As if its process died: its tasks stop and nothing of `stop` runs."""
    for task in (client._reader, *client._chores):
        task.cancel()


def test_a_killed_clients_topic_is_reaped_after_the_grace_and_a_live_ones_never():
    async def main():
        bus = MemoryBus()
        # NOTE: a grace of many heartbeats: a loaded machine's stalls must not pass for a death.
        fast = {"bus": bus, "topic_prefix": PREFIX, "heartbeat_s": 0.05, "reap_grace_s": 1.0}
        dead, live = Client(**fast), Client(**fast)
        await dead.start()
        await live.start()
        await asyncio.sleep(0.1)
        killed(dead)
        assert await replies.reap(bus, PREFIX, grace_s=1.0) == []  # within the grace
        for _ in range(14):  # well past the grace: only the dead one goes
            await asyncio.sleep(0.1)
            deleted = await replies.reap(bus, PREFIX, grace_s=1.0)
            assert live.reply_topic not in deleted and live.reply_topic in bus.topics
        assert reply_topics(bus) == [live.reply_topic]
        # A new client reaps as it starts: the live one's topic stays, a dead one's goes.
        other = Client(**fast)
        await other.start()
        await asyncio.sleep(0.1)  # its heartbeat is kept (killed sooner: the reaper's grace)
        killed(other)
        await asyncio.sleep(1.2)
        async with Client(**fast) as newest:
            await asyncio.wait(newest._chores[1:], timeout=1)
            assert reply_topics(bus) == sorted([live.reply_topic, newest.reply_topic])
        await live.stop()
        assert reply_topics(bus) == []

    asyncio.run(main())


def test_a_reply_topic_without_a_heartbeat_gets_its_grace_from_the_reaper():
    async def main():
        bus = MemoryBus()
        orphan = replies.new_reply_topic(PREFIX)  # a client from before heartbeats, say
        await bus.create_topics([orphan])
        now = replies.now_ms()
        assert await replies.reap(bus, PREFIX, grace_s=60, at_ms=now) == []
        assert await replies.reap(bus, PREFIX, grace_s=60, at_ms=now + 59_000) == []
        assert await replies.reap(bus, PREFIX, grace_s=60, at_ms=now + 61_000) == [orphan]
        assert orphan not in bus.topics

    asyncio.run(main())


class _GoneBus(MemoryBus):
    """A broker that stopped answering: every admin call waits forever."""

    async def delete_topics(self, topics):
        await asyncio.Event().wait()

    async def save_progress_many(self, group_id, offsets):
        await asyncio.Event().wait()

    async def close(self):
        await asyncio.Event().wait()


def test_stop_after_the_broker_is_gone_neither_hangs_nor_raises():
    async def main():
        bus = _GoneBus()
        client = Client(bus=bus, topic_prefix=PREFIX)
        await client.start()
        await asyncio.sleep(0.05)  # the heartbeat is stuck in its send
        began = time.monotonic()
        await client.stop()
        return time.monotonic() - began

    took = asyncio.run(main())
    assert took < 2 * client_module.PROBE_S + 1


def test_a_client_stopped_with_open_streams_aborts_them_and_leaves_its_topic_to_the_reaper():
    """Their last events come after the stop: a deleted topic would be created again by them
    (or, on a Kafka without auto-create, have them wait on it)."""

    async def main():
        bus = MemoryBus()
        client = Client(bus=bus, topic_prefix=PREFIX)
        await client.start()
        request_id = await client.submit(prompt="Once upon a time")
        await client.stop()
        requests = bus.topics[f"{PREFIX}requests"]
        sent = [r.key for r in requests]
        assert sent == [request_id.encode(), request_id.encode()]  # the request, then its abort
        assert reply_topics(bus) == [client.reply_topic]
        # A client that cancelled a moment ago keeps its topic too; one that did not deletes it.
        quiet = Client(bus=bus, topic_prefix=PREFIX)
        await quiet.start()
        await quiet.cancel("gone")
        await quiet.stop()
        assert quiet.reply_topic in bus.topics
        settled = Client(bus=bus, topic_prefix=PREFIX)
        await settled.start()
        await settled.stop()
        assert settled.reply_topic not in bus.topics

    asyncio.run(main())


def _event_out(request_id, index, to="t.tokens.0123456789ab", json=False, **fields):
    headers = (
        (topics.REPLY_TOPIC, to.encode()),
        (topics.REPLY_BATCHES, b"1"),
        ("traceparent", request_id.encode()),
    )
    if json:
        headers += ((topics.CONTENT_TYPE, topics.JSON),)
    event = TokenEvent(request_id=request_id, index=index, token_ids=(index,), **fields)
    return Outgoing(topics.TOKENS, event, replies.reply_key(request_id, to, headers), headers, to)


def _shape(outgoing):
    """Each record as the (request id, index) of its events."""
    return [
        [(e.request_id, e.index) for e in o.message.events]
        if isinstance(o.message, TokenEventBatch)
        else (o.message.request_id, o.message.index)
        for o in outgoing
    ]


def test_batches_keep_each_requests_order_around_events_that_go_alone(monkeypatch):
    logprobs = (TokenLogprobs(token_ids=(1,), logprobs=(-0.5,), ranks=(1,)),)
    other = "t.tokens.ba9876543210"
    outgoing = [
        _event_out("a", 0), _event_out("b", 0), _event_out("c", 0, to=other), _event_out("j", 0, json=True),
        _event_out("a", 1, logprobs=logprobs),  # alone: it closes its topic's batches
        _event_out("b", 1), _event_out("a", 2), _event_out("j", 1, json=True), _event_out("c", 1, to=other),
    ]  # fmt: skip
    merged = replies.batch_events(outgoing)
    assert _shape(merged) == [
        [("a", 0), ("b", 0)], [("c", 0), ("c", 1)], ("j", 0),  # a batch of one: the event's own record
        ("a", 1), [("b", 1), ("a", 2)], ("j", 1),
    ]  # fmt: skip
    assert all(o.key == o.to for o in merged)
    assert merged[0].message.traceparents == ("a", "b")
    assert sum(len(o.parts) or 1 for o in merged) == len(outgoing)
    monkeypatch.setattr(replies, "MAX_BATCH_EVENTS", 2)
    capped = replies.batch_events([_event_out(r, 0) for r in "uvwxy"])
    assert _shape(capped) == [[("u", 0), ("v", 0)], [("w", 0), ("x", 0)], ("y", 0)]
    # JSON requests' events are batched among themselves, in JSON.
    (both,) = replies.batch_events([_event_out("j", 0, json=True), _event_out("k", 0, json=True)])
    assert both.headers == ((topics.CONTENT_TYPE, topics.JSON),)
    assert (
        topics.TopicDecoder(topics.TOKENS).decode(topics.encode(both.message, both.headers), topics.JSON)
        == both.message
    )
