"""One instance of each service on a set of topics: one tokenizer, and one scheduler and one
executor per engine replica (each claims `<service>.replica-R`; replica 0 the plain name).

A second scheduler, executor or tokenizer on the same topics jams the pipeline: two consumers
handling every record and committing one group's offsets, two schedulers planning steps for one
executor, two tokenizers answering every request. So every service sends an
`InstanceHeartbeat` each `HEARTBEAT_S` on the instances topic, and one that starts first listens
`CLAIM_WAIT_S` from its own first heartbeat: a heartbeat of another instance of the same service
that started before it (a smaller `since`) means that one is alive, and this one refuses to
start (`DuplicateInstanceError`); the first one is never disturbed.

NOTE: liveness by heartbeats read after our own, not by group membership: a broker may keep a
killed member in its group's description for a long time (Tansu does), and a service restarted
after a crash must not be refused because of its dead predecessor. A dead instance sends
nothing after our first heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import msgspec

from parkade.schemas import InstanceHeartbeat, topics
from parkade.services.bus.base import Bus, Outgoing
from parkade.services.bus.serve import send_all

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
# Over three heartbeats: room for a live instance whose event loop is busy for two seconds.
CLAIM_WAIT_S = 3.5


class DuplicateInstanceError(RuntimeError):
    """Another instance of this service is serving the same topics."""


@contextlib.asynccontextmanager
async def single_instance(
    bus: Bus,
    service: str | tuple[str, ...],
    prefix: str,
    instance_id: str,
    *,
    heartbeat_s: float = HEARTBEAT_S,
    claim_wait_s: float = CLAIM_WAIT_S,
) -> AsyncIterator[None]:
    """Claim the service on these topics (raises DuplicateInstanceError), then keep heartbeating
    until the block ends. Several services that share a process (`parkade replica`) are claimed
    together: a heartbeat each, and one wait."""
    names = (service,) if isinstance(service, str) else service

    def beat(since: dict[str, int]) -> list[Outgoing]:
        host, pid = socket.gethostname(), os.getpid()
        return [
            Outgoing(
                topics.INSTANCES,
                InstanceHeartbeat(service=n, instance_id=instance_id, since=since[n], host=host, pid=pid),
                n,
            )
            for n in names
        ]

    offsets = await send_all(bus, beat(dict.fromkeys(names, -1)), prefix)
    since = dict(zip(names, offsets, strict=True))

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(heartbeat_s)
            try:
                await send_all(bus, beat(since), prefix)
            except Exception as error:  # a heartbeat lost is not worth stopping a service for
                log.warning("instance heartbeat not sent: %s", error)

    task = asyncio.create_task(heartbeats())
    try:
        await _listen(bus, prefix, instance_id, since, claim_wait_s)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _listen(bus: Bus, prefix: str, instance_id: str, since: dict[str, int], wait_s: float) -> None:
    """Raise DuplicateInstanceError on a heartbeat of another instance of one of the services
    (`since`: each one's first heartbeat) that started before it."""
    name = topics.topic_name(topics.INSTANCES, prefix)
    decoder = topics.decoder(topics.INSTANCES)
    consumer = await bus.consumer([name], None, start={name: min(since.values())})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    try:
        while (left := deadline - loop.time()) > 0:
            for record in await consumer.getmany(timeout_ms=max(int(left * 1000), 1)):
                try:
                    other = decoder.decode(record.value)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                mine = since.get(other.service)
                if mine is not None and other.instance_id != instance_id and 0 <= other.since < mine:
                    raise DuplicateInstanceError(
                        f"another {other.service} is serving the topics {prefix}* (instance "
                        f"{other.instance_id}, pid {other.pid} on {other.host or 'an unknown host'}); a "
                        "second one would jam the pipeline. Stop that one first; for another engine "
                        "replica give this one another --replica name, for another deployment another "
                        "--topic-prefix."
                    )
    finally:
        await consumer.stop()
