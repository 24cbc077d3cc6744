"""Starting and stopping a service process: what the three services' `main.py` share.

    parser = service_parser("scheduler", __doc__)   # --bootstrap-servers, --topic-prefix, ...
    return run_service("scheduler", parser, args, build_service)

`run_service` checks the settings and builds the service (a `Service`, see serve.py; a bad
setting or model folder: one line, exit 2), waits for the broker (unreachable: one line, exit 1),
creates the missing topics (one with several partitions: one line, exit 2), claims the service
on these topics (another instance serving them: one line, exit 3; see `instances.py`), runs
`serve` until SIGINT or SIGTERM, and prints `READY <service>` once the service consumes its
topics (the line `parkade up` waits for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from parkade.schemas import topics
from parkade.schemas.routing import DEFAULT_REPLICA
from parkade.schemas.topics import DEFAULT_PREFIX
from parkade.services.bus.serve import Service, serve
from parkade.services.common import logs, tracing
from parkade.services.common.heap import freeze_startup_heap
from parkade.services.common.timeline import StepTimeline

log = logging.getLogger(__name__)
BROKER_WAIT_S = 10.0
EXIT_DUPLICATE = 3  # another instance serves these topics: `parkade up` does not restart it


def service_parser(name: str, description: str | None, *, replica: bool = False) -> argparse.ArgumentParser:
    """A service's argument parser with the bus arguments every service takes (`replica`: and
    --replica, for the scheduler and the executor)."""
    # NOTE: the description is the service's module docstring: its layout (lists, tables) kept.
    parser = argparse.ArgumentParser(
        prog=f"parkade {name}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    if replica:
        parser.add_argument(
            "--replica",
            default=os.environ.get("PARKADE_REPLICA", DEFAULT_REPLICA),
            help="the engine replica it belongs to (a scheduler and an executor with their KV pool; "
            "a stable name, kept across restarts): replica 0 uses the plain topics, replica R its own "
            "replica-R.* step topics (default: $PARKADE_REPLICA, else 0)",
        )
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help="Kafka bootstrap servers (default: $KAFKA_BOOTSTRAP_SERVERS)",
    )
    parser.add_argument("--topic-prefix", default=DEFAULT_PREFIX, help=f"(default: {DEFAULT_PREFIX})")
    parser.add_argument(
        "--idempotence",
        action=argparse.BooleanOptionalAction,
        default=idempotence_from_env(),
        help="idempotent producing (Apache Kafka; not Tansu's memory mode). Default: off, or "
        "$PARKADE_KAFKA_IDEMPOTENCE=1",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ["PARKADE_METRICS_PORT"]) if os.environ.get("PARKADE_METRICS_PORT") else None,
        help="serve Prometheus metrics at :PORT/metrics (default: $PARKADE_METRICS_PORT; unset: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get("PARKADE_METRICS_HOST", "0.0.0.0"),
        help="address of the metrics endpoint (default: $PARKADE_METRICS_HOST, else 0.0.0.0)",
    )
    parser.add_argument(
        "--broker-wait",
        type=float,
        default=BROKER_WAIT_S,
        help=f"seconds to wait for the broker to answer at start (default: {BROKER_WAIT_S:g})",
    )
    return parser


def idempotence_from_env() -> bool:
    """--idempotence's default, for a service and for `parkade up`: $PARKADE_KAFKA_IDEMPOTENCE."""
    return os.environ.get("PARKADE_KAFKA_IDEMPOTENCE", "") in ("1", "true", "yes")


def run_service(
    name: str, parser: argparse.ArgumentParser, args: argparse.Namespace, build: Callable[[], Service]
) -> int:
    """Build the service, connect, serve until a signal; -> the process's exit code."""
    if not args.bootstrap_servers:
        parser.error("no broker: pass --bootstrap-servers or set KAFKA_BOOTSTRAP_SERVERS")
    _exit_on_sigterm()
    if not connection_settings_ok(name):
        return 2
    logs.configure(name)
    tracing.configure(name, os.environ)
    try:
        service = build()
    except ValueError as error:  # settings or a model folder that cannot work: say so, no traceback
        print(f"parkade {name}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading: a normal stop
        return 0
    if args.metrics_port is not None and not serve_metrics(name, args, service.enable_metrics().registry):
        return 1
    timeline_dir = os.environ.get("PARKADE_STEP_TIMELINE")  # benchmarks: see common/timeline.py
    if timeline_dir:
        service.timeline = StepTimeline()

    async def serve_forever(stop: asyncio.Event) -> None:
        await on_kafka(
            args.bootstrap_servers,
            args.topic_prefix,
            name,
            lambda bus: serve(bus, service, prefix=args.topic_prefix, stop=stop, ready=_announce_ready(name)),
            wait_s=args.broker_wait,
            idempotence=args.idempotence,
            instance=service.instance_name or name,
            own_topics=service.own_topics(),
        )

    from parkade.services.bus.instances import DuplicateInstanceError
    from parkade.services.bus.kafka import BrokerUnreachableError, TopicLayoutError

    try:
        return run_until_signalled(serve_forever)
    except BrokerUnreachableError as error:
        print(
            f"parkade {name}: cannot reach the broker at {args.bootstrap_servers}: {error}", file=sys.stderr
        )
        return 1
    except TopicLayoutError as error:
        print(f"parkade {name}: {error}", file=sys.stderr)
        return 2
    except DuplicateInstanceError as error:
        print(f"parkade {name}: refusing to start: {error}", file=sys.stderr)
        return EXIT_DUPLICATE
    finally:
        tracing.shutdown()  # what is buffered goes out
        if service.timeline is not None:
            service.timeline.dump(Path(timeline_dir) / f"{name}.json")


def connection_settings_ok(name: str) -> bool:
    """False after saying in one line why the TLS/SASL settings of the environment (see
    security.py) cannot work: before anything connects."""
    from parkade.services.bus.security import client_settings

    try:
        client_settings(os.environ)
    except ValueError as error:
        print(f"parkade {name}: {error}", file=sys.stderr)
        return False
    return True


def serve_metrics(name: str, args: argparse.Namespace, registry: Any) -> bool:
    """Serve `registry` at --metrics-host:--metrics-port/metrics (a thread); False after saying
    in one line why it cannot."""
    from prometheus_client import start_http_server

    try:
        start_http_server(args.metrics_port, args.metrics_host, registry=registry)
    except OSError as error:
        print(f"parkade {name}: cannot serve metrics on port {args.metrics_port}: {error}", file=sys.stderr)
        return False
    return True


async def on_kafka(
    bootstrap_servers: str,
    prefix: str,
    service: str,
    run: Callable[[Any], Awaitable[None]],
    *,
    wait_s: float = BROKER_WAIT_S,
    idempotence: bool = False,
    instance: str | None = None,
    own_topics: tuple[str, ...] = (),
) -> None:
    """Wait for the broker, create any missing topic (`own_topics`: unprefixed, beyond every
    deployment's), claim `instance` (default: `service`) on the topics, `run(bus)` (heartbeating),
    close the bus."""
    from parkade.services.bus.instances import single_instance
    from parkade.services.bus.kafka import KafkaBus, wait_for_broker

    await wait_for_broker(bootstrap_servers, timeout_s=wait_s)
    bus = KafkaBus(bootstrap_servers, client_id=f"parkade-{service}", idempotence=idempotence)
    try:
        await bus.create_topics(
            topics.all_topic_names(prefix) + [topics.topic_name(t, prefix) for t in own_topics]
        )
        # NOTE: not before: a service that cannot start says so in one line and nothing else.
        log.info("starting: broker %s, topics %s*", bootstrap_servers, prefix, extra={"topic": prefix})
        async with single_instance(bus, instance or service, prefix, uuid.uuid4().hex):
            await run(bus)
    finally:
        await bus.close()


def _announce_ready(service: str) -> Callable[[], None]:
    """The line `parkade up` waits for: printed once the service consumes its topics."""

    def ready() -> None:
        frozen = freeze_startup_heap()  # before serving: see heap.py
        log.info("ready (%d start-up objects frozen out of the garbage collector)", frozen)
        # The protocol line `parkade up` waits for (stdout; the logs go to stderr).
        sys.stdout.write(f"READY {service}\n")
        sys.stdout.flush()

    return ready


def _exit_on_sigterm() -> None:
    """Until the event loop takes over: SIGTERM during start-up (loading a model) exits 0."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def run_until_signalled(serve: Callable[[asyncio.Event], Awaitable[None]]) -> int:
    """Run `serve(stop)`; SIGINT or SIGTERM sets `stop`, and the service finishes its batch."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def stopping(sig: signal.Signals) -> None:
            if not stop.is_set():
                log.info("stopping (%s): finishing what is in flight", sig.name)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stopping, sig)
        await serve(stop)
        log.info("stopped")

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    sys.stdout.flush()
    return 0
