"""The scheduler service: `parkade scheduler`. Its only I/O edge."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import read_log, send_all, serve
from parkade.services.common.flags import Flag, add_flags, dataclass_flags, flag_values
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.handler import (
    DEFAULT_EXECUTOR_TIMEOUT_S,
    DEFAULT_EXECUTOR_WAIT_S,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_STEP_TIMEOUT_S,
    SchedulerHandler,
)

GROUP_ID = "parkade-scheduler"
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


async def run(
    bus: Bus,
    handler: SchedulerHandler,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
) -> None:
    # Resume what a predecessor left (see SchedulerHandler): the generated topic from the saved
    # progress up to this scheduler's announcement. Without a saved progress, from the start.
    (marker,) = await send_all(bus, [handler.announcement()], prefix)
    start = await bus.load_progress(f"{GROUP_ID}.progress", topics.topic_name(topics.GENERATED, prefix))
    start = start or 0
    handler.recover(start, await read_log(bus, topics.GENERATED, prefix, start, marker))
    await serve(
        bus,
        prefix=prefix,
        group_id=GROUP_ID,
        handlers={
            topics.TOKENIZED: lambda message, record: handler.on_tokenized(
                message, record.headers, record.offset
            ),
            topics.STEP_RESULTS: lambda message, record: handler.on_step_results(message),
        },
        after_batch=handler.next_plans,
        stop=stop,
        ready=ready,
        poll_ms=10,
        on_send_error=handler.on_send_error,
        metrics=handler.metrics,
        on_sent=handler.on_sent,
        low_watermarks=handler.low_watermarks,
        progress=handler.progress,
    )


def build_handler(args: argparse.Namespace) -> SchedulerHandler:
    """The handler for parsed FLAGS; ValueError for settings that cannot work."""
    values = flag_values(FLAGS, args)
    service = {flag.name: values.pop(flag.name) for flag in SERVICE_FLAGS}
    return SchedulerHandler(SchedulingOptions(**values), **service)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("scheduler", __doc__)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    return run_service("scheduler", parser, args, lambda: build_handler(args), run)
