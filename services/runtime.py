"""What the three services' `main.py` share: bus arguments, READY, and stopping on a signal."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from parkade.schemas import topics
from parkade.schemas.topics import DEFAULT_PREFIX


def add_bus_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)",
    )
    parser.add_argument("--topic-prefix", default=DEFAULT_PREFIX)


def require_bootstrap(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    if not args.bootstrap_servers:
        parser.error("no broker: pass --bootstrap-servers or set KAFKA_BOOTSTRAP_SERVERS")
    return args.bootstrap_servers


def announce_ready(service: str) -> Callable[[], None]:
    """The line `parkade up` waits for: printed once the service consumes its topics."""

    def ready() -> None:
        print(f"READY {service}", flush=True)

    return ready


async def on_kafka(
    bootstrap_servers: str, prefix: str, client_id: str, serve: Callable[[Any], Awaitable[None]]
) -> None:
    """Connect to the broker, create any missing topic, run `serve(bus)`, close the bus."""
    from parkade.services.bus.kafka import KafkaBus

    bus = KafkaBus(bootstrap_servers, client_id=client_id)
    await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
    try:
        await serve(bus)
    finally:
        await bus.close()


def exit_on_sigterm() -> None:
    """Until the event loop takes over: SIGTERM during start-up (loading a model) exits 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `serve(stop)`; SIGINT or SIGTERM sets `stop`, and the service finishes its batch."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(stop)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    sys.stdout.flush()
    return 0
