"""`parkade.client`: submit requests to a running Parkade and stream their tokens.

    async with Client() as client:   # the broker of $KAFKA_BOOTSTRAP_SERVERS or `parkade up`
        async for event in client.generate(prompt="Once upon a time", sampling_params=params):
            print(event.text, end="")

`Client` is `parkade.services.bus.client.RequestClient` (reply topics, timeouts, aborts: see
there) with the broker found for you. Stop it (`async with`, or `await client.stop()`): that
deletes its reply topic; one left by a client that died is deleted by the next client to start
once its grace has passed (`parkade.services.bus.replies`).
"""

from __future__ import annotations

import os

from parkade import home
from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.client import (
    DEFAULT_IDLE_TIMEOUT_S,
    PROBE_S,
    PipelineGoneError,
    RequestClient,
    new_traceparent,
)
from parkade.services.bus.replies import HEARTBEAT_S, REAP_GRACE_S

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "PROBE_S",
    "Client",
    "NoBrokerError",
    "PipelineGoneError",
    "find_broker",
    "new_traceparent",
]


class NoBrokerError(RuntimeError):
    """No broker was given and none could be found."""


def find_broker(bootstrap_servers: str | None = None, topic_prefix: str | None = None) -> tuple[str, str]:
    """(bootstrap servers, topic prefix) of the Parkade to talk to: the ones given, else
    $KAFKA_BOOTSTRAP_SERVERS, else those of the `parkade up` running on this machine. The prefix
    not given is `parkade up`'s where it runs on that broker, else `parkade.`.

    Raises NoBrokerError when there is none."""
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    state = home.read_state()
    if bootstrap:  # `parkade up`'s prefix still, where it runs on that broker
        same = state is not None and state.get("bootstrap_servers") == bootstrap
        return bootstrap, topic_prefix or (state["topic_prefix"] if same else topics.DEFAULT_PREFIX)
    if state is None:
        raise NoBrokerError(
            "no broker: start one with `parkade up`, or pass bootstrap servers (--bootstrap-servers) "
            "or set KAFKA_BOOTSTRAP_SERVERS"
        )
    return state["bootstrap_servers"], topic_prefix or state["topic_prefix"]


class Client(RequestClient):
    def __init__(
        self,
        bootstrap_servers: str | None = None,
        topic_prefix: str | None = None,
        *,
        bus: Bus | None = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        own_reply_topic: bool = True,
        heartbeat_s: float = HEARTBEAT_S,
        reap_grace_s: float = REAP_GRACE_S,
    ) -> None:
        """Talk to the broker `bootstrap_servers` (default: see `find_broker`), or over `bus`."""
        if bus is None:
            from parkade.services.bus.kafka import KafkaBus

            bootstrap_servers, topic_prefix = find_broker(bootstrap_servers, topic_prefix)
            bus = KafkaBus(bootstrap_servers, client_id="parkade-client")
        super().__init__(
            bus,
            topic_prefix,
            bootstrap_servers=bootstrap_servers,
            idle_timeout_s=idle_timeout_s,
            own_reply_topic=own_reply_topic,
            heartbeat_s=heartbeat_s,
            reap_grace_s=reap_grace_s,
        )

    async def __aenter__(self) -> Client:
        await self.start()
        return self
