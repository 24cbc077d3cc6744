"""Clients' reply topics on a real broker (Tansu): deleted when their client stops, reaped once
their client was killed (SIGKILL) and its grace passed, never while their client lives; a stop
after the broker is gone neither hangs nor raises."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from parkade.client import Client
from parkade.services.bus import replies
from parkade.services.bus.kafka import KafkaBus

pytestmark = pytest.mark.e2e
PREFIX = "reply-test."

# A client in a process of its own, which prints its reply topic once its heartbeat is kept.
_CHILD = """
import asyncio, sys
from parkade.client import Client

async def main():
    client = Client(sys.argv[1], sys.argv[2], heartbeat_s=0.2)
    await client.start()
    await asyncio.sleep(0.5)
    print(client.reply_topic, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def reply_topics(bus):
    return sorted(t for t in await bus.list_topics() if replies.is_reply_topic(t, PREFIX))


def test_a_stopped_clients_reply_topic_is_deleted(module_broker):
    async def main():
        bus = KafkaBus(module_broker)
        try:
            async with Client(module_broker, PREFIX) as client:
                assert client.reply_topic in await reply_topics(bus)
            await asyncio.sleep(1.0)  # nothing creates it again
            assert client.reply_topic not in await reply_topics(bus)
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_killed_clients_topic_is_reaped_after_the_grace_and_a_live_ones_never(module_broker):
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, module_broker, PREFIX], stdout=subprocess.PIPE, text=True
    )
    try:
        dead = child.stdout.readline().strip()
        assert replies.is_reply_topic(dead, PREFIX), dead
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()

    async def main():
        bus = KafkaBus(module_broker)
        try:
            async with Client(module_broker, PREFIX, heartbeat_s=0.2) as live:
                assert await replies.reap(bus, PREFIX, grace_s=2.0) == []  # within the grace
                deadline = time.monotonic() + 10
                while dead in await reply_topics(bus):
                    assert time.monotonic() < deadline, "the dead client's topic was never reaped"
                    await asyncio.sleep(0.3)
                    assert live.reply_topic not in await replies.reap(bus, PREFIX, grace_s=2.0)
                assert live.reply_topic in await reply_topics(bus)
        finally:
            await bus.close()

    asyncio.run(main())


def test_a_stop_after_the_broker_is_gone_is_bounded(tmp_path):
    from conftest import start_tansu

    broker, bootstrap = start_tansu()  # its own: it is killed

    async def main():
        from parkade.services.bus.kafka import wait_for_broker

        await wait_for_broker(bootstrap, timeout_s=60)
        client = Client(bootstrap, PREFIX)
        await client.start()
        broker.kill()
        broker.wait()
        began = time.monotonic()
        await client.stop()
        return time.monotonic() - began

    try:
        took = asyncio.run(main())
    finally:
        broker.kill()
        broker.wait()
    assert took < 3 * 2.0 + 1


def test_parkade_topics_lists_the_reply_topics_and_reaps_the_old_ones(module_broker, capsys):
    from parkade.cli import main as cli

    async def orphan():  # a reply topic no client keeps a heartbeat for
        bus = KafkaBus(module_broker)
        try:
            name = replies.new_reply_topic(PREFIX)
            await bus.create_topics([name], single_partition=False)
            return name
        finally:
            await bus.close()

    name = asyncio.run(orphan())
    broker = ["--bootstrap-servers", module_broker, "--topic-prefix", PREFIX]
    assert cli(["topics", *broker]) == 0
    assert name in capsys.readouterr().out.split()
    assert cli(["topics", *broker, "--reap", "--grace", "0.5"]) == 0  # its grace starts now
    assert name in capsys.readouterr().out.split()
    time.sleep(1.0)
    assert cli(["topics", *broker, "--reap", "--grace", "0.5"]) == 0
    out, err = capsys.readouterr()
    assert name not in out.split() and "[deleted 1 reply topics" in err
