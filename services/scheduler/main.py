"""The scheduler service: `parkade scheduler`. Its only I/O edge."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import send_all, serve
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.handler import DEFAULT_MAX_IN_FLIGHT, SchedulerHandler

GROUP_ID = "parkade-scheduler"
FLAGS = dataclass_flags(SchedulingOptions)


async def run(
    bus: Bus,
    handler: SchedulerHandler,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
) -> None:
    await send_all(bus, [handler.announcement()], prefix)
    await serve(
        bus,
        prefix=prefix,
        group_id=GROUP_ID,
        handlers={
            topics.TOKENIZED: lambda message, record: handler.on_tokenized(message, record.headers),
            topics.STEP_RESULTS: lambda message, record: handler.on_step_results(message),
        },
        after_batch=handler.next_plans,
        stop=stop,
        ready=ready,
        poll_ms=10,
    )


def add_arguments(parser) -> None:
    """The scheduler's flags: every `SchedulingOptions` field, and --max-in-flight."""
    add_flags(parser, FLAGS)
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=DEFAULT_MAX_IN_FLIGHT,
        help=f"step plans out at once (default: {DEFAULT_MAX_IN_FLIGHT})",
    )


def build_handler(args) -> SchedulerHandler:
    return SchedulerHandler(SchedulingOptions(**flag_values(FLAGS, args)), max_in_flight=args.max_in_flight)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("scheduler", __doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_service("scheduler", parser, args, lambda: build_handler(args), run)
