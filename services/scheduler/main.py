"""The scheduler service: `parkade scheduler`. Its only I/O edge."""

from __future__ import annotations

import argparse
import logging

from parkade.schemas import topics
from parkade.schemas.routing import DEFAULT_REPLICA, check_replica_name
from parkade.services.bus.base import Bus
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import read_log, send_all
from parkade.services.common.flags import Flag, add_flags, dataclass_flags, flag_values
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.executor_link import (
    DEFAULT_EXECUTOR_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_STEP_TIMEOUT_S,
)
from parkade.services.scheduler.handler import DEFAULT_EXECUTOR_WAIT_S, SchedulerHandler

# Every SchedulingOptions field, and the service's own settings.
SERVICE_FLAGS = [
    Flag("max_in_flight", int, DEFAULT_MAX_IN_FLIGHT, "step plans out at once"),
    Flag(
        "executor_timeout_s",
        float,
        DEFAULT_EXECUTOR_TIMEOUT_S,
        "seconds without a word from the executor after which it is declared lost",
    ),
    Flag(
        "step_timeout_s",
        float,
        DEFAULT_STEP_TIMEOUT_S,
        "seconds without the answer to a step after which the steps in flight are void",
    ),
    Flag(
        "executor_wait_s",
        float,
        DEFAULT_EXECUTOR_WAIT_S,
        "seconds a request may wait without an executor before it ends with an error",
    ),
]
FLAGS = [*dataclass_flags(SchedulingOptions), *SERVICE_FLAGS]
log = logging.getLogger(__name__)


class SchedulerService(SchedulerHandler):
    """The handler with its start-up I/O: resume what a predecessor left (see SchedulerHandler),
    reading the generated topic from the saved progress up to this scheduler's announcement
    (without a saved progress, from the start)."""

    bus: Bus | None = None
    prefix = topics.DEFAULT_PREFIX

    async def start(self, bus: Bus, prefix: str) -> None:
        self.bus, self.prefix = bus, prefix
        (marker,) = await send_all(bus, [self.announcement()], prefix)
        generated = topics.topic_name(topics.GENERATED, prefix)
        start = await bus.load_progress(f"{self.group_id}.progress", generated) or 0
        self.recover(start, await read_log(bus, topics.GENERATED, prefix, start, marker))

    async def stop(self) -> None:
        """A clean stop (SIGTERM) drains the replica: its last status says so, and the tokenizer
        hands what it holds over to the other replicas at once (docs/design.md, "Engine replicas
        and routing")."""
        if self.bus is None:
            return
        self.publisher.draining = True
        try:
            await send_all(self.bus, self.replica_records(force=True), self.prefix)
        except Exception as error:  # the broker is away: the tokenizer times the replica out
            log.warning("the draining status was not sent: %s", error)


def build_service(args: argparse.Namespace) -> SchedulerService:
    """The service for parsed FLAGS; ValueError for settings that cannot work."""
    values = flag_values(FLAGS, args)
    service = {flag.name: values.pop(flag.name) for flag in SERVICE_FLAGS}
    replica = check_replica_name(getattr(args, "replica", DEFAULT_REPLICA))
    return SchedulerService(SchedulingOptions(**values), replica=replica, **service)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("scheduler", __doc__, replica=True)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    return run_service("scheduler", parser, args, lambda: build_service(args))
