"""Starting and stopping a service process: what the three services' `main.py` share.

    parser = service_parser("scheduler", __doc__)   # --bootstrap-servers, --topic-prefix, ...
    return run_service("scheduler", parser, args, build_service)

`run_service` checks the settings and builds the service (a `Service`, see serve.py; a bad
setting or model folder: one line, exit 2), waits for the broker (unreachable: one line, exit 1),
creates the missing topics (one with several partitions: one line, exit 2), claims the service
on these topics (another instance serving them: one line, exit 3; see `instances.py`), runs
`serve` until SIGINT or SIGTERM, and prints `READY <service>` once the service consumes its
topics (the line `parkade up` waits for).

Several services may share one process (`parkade replica`: a scheduler and its executor): `build`
returns them by name, each is claimed and served as if alone, `local_topics` (the ones only they
exchange) stay in memory (split.py), their metrics share one endpoint, and READY comes once all
of them consume.
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
from parkade.services.bus.serve import Service, serve_together
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
    name: str,
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    build: Callable[[], Service | dict[str, Service]],
    *,
    local_topics: tuple[str, ...] = (),
) -> int:
    """Build the service (or the services sharing this process, by name), connect, serve until a
    signal; -> the process's exit code. `local_topics` (unprefixed): topics only these services
    read and write, kept in this process's memory."""
    if not args.bootstrap_servers:
        parser.error("no broker: pass --bootstrap-servers or set KAFKA_BOOTSTRAP_SERVERS")
    _exit_on_sigterm()
    if not connection_settings_ok(name):
        return 2
    logs.configure(name)
    tracing.configure(name, os.environ)
    try:
        built = build()
    except ValueError as error:  # settings or a model folder that cannot work: say so, no traceback
        print(f"parkade {name}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while loading: a normal stop
        return 0
    services = built if isinstance(built, dict) else {name: built}
    if args.metrics_port is not None:
        registries = [service.enable_metrics().registry for service in services.values()]
        if not serve_metrics(name, args, registries[0] if len(registries) == 1 else merged(registries)):
            return 1
    timeline_dir = os.environ.get("PARKADE_STEP_TIMELINE")  # benchmarks: see common/timeline.py
    for service in services.values() if timeline_dir else ():
        service.timeline = StepTimeline()

    async def serve_forever(stop: asyncio.Event) -> None:
        await on_kafka(
            args.bootstrap_servers,
            args.topic_prefix,
            name,
            lambda bus: serve_together(
                bus, list(services.values()), prefix=args.topic_prefix, stop=stop, ready=_announce_ready(name)
            ),
            wait_s=args.broker_wait,
            idempotence=args.idempotence,
            instances=[service.instance_name or key for key, service in services.items()],
            own_topics=tuple(t for service in services.values() for t in service.own_topics()),
            local_topics=tuple(topics.topic_name(t, args.topic_prefix) for t in local_topics),
        )

    try:
        return until_signalled(name, args, serve_forever)
    finally:
        tracing.shutdown()  # what is buffered goes out
        for key, service in services.items():
            if service.timeline is not None:
                service.timeline.dump(Path(timeline_dir) / f"{key}.json")


def until_signalled(
    name: str,
    args: argparse.Namespace,
    serve_forever: Callable[[asyncio.Event], Awaitable[None]],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """`run_until_signalled`, with the start-up failures said in one line; -> the exit code."""
    from parkade.services.bus.instances import DuplicateInstanceError
    from parkade.services.bus.kafka import BrokerUnreachableError, TopicLayoutError

    try:
        return run_until_signalled(serve_forever, loop_factory)
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


def merged(registries: list[Any]) -> Any:
    """One registry that serves what `registries` hold (families of one name, e.g. each
    service's consumer lag, merged into one: their samples differ by labels)."""
    from prometheus_client import CollectorRegistry

    class Both:
        def collect(self) -> Any:
            families: dict[str, Any] = {}
            for registry in registries:
                for family in registry.collect():
                    if family.name in families:
                        families[family.name].samples.extend(family.samples)
                    else:
                        families[family.name] = family
            return iter(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Both())
    return registry


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
    instances: list[str] | None = None,
    own_topics: tuple[str, ...] = (),
    local_topics: tuple[str, ...] = (),
    local: Any = None,
) -> None:
    """Wait for the broker, create any missing topic (`own_topics`: unprefixed, beyond every
    deployment's), claim each of `instances` (default: `service`) on the topics, `run(bus)`
    (heartbeating), close the bus. `local_topics` (full names): kept in memory (split.py), in
    `local` (a MemoryBus another bus of this process shares) if given."""
    from parkade.services.bus.instances import single_instance
    from parkade.services.bus.kafka import KafkaBus, wait_for_broker
    from parkade.services.bus.split import SplitBus

    await wait_for_broker(bootstrap_servers, timeout_s=wait_s)
    kafka = KafkaBus(bootstrap_servers, client_id=f"parkade-{service}", idempotence=idempotence)
    bus = SplitBus(kafka, local_topics, local=local) if local_topics else kafka
    try:
        await bus.create_topics(
            topics.all_topic_names(prefix) + [topics.topic_name(t, prefix) for t in own_topics]
        )
        # NOTE: not before: a service that cannot start says so in one line and nothing else.
        log.info("starting: broker %s, topics %s*", bootstrap_servers, prefix, extra={"topic": prefix})
        async with single_instance(bus, tuple(instances or [service]), prefix, uuid.uuid4().hex):
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


def run_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]],
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
) -> int:
    """Run `serve(stop)` on a loop from `loop_factory` (None: asyncio's own); SIGINT or SIGTERM
    sets `stop`, and the service finishes its batch."""

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

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    sys.stdout.flush()
    return 0
