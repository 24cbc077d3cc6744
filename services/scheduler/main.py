"""The scheduler service: `parkade scheduler`. Its only I/O edge."""

from __future__ import annotations

import argparse
import asyncio

from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.serve import send_all, serve
from parkade.services.runtime import (
    add_bus_arguments,
    announce_ready,
    exit_on_sigterm,
    on_kafka,
    require_bootstrap,
    run_until_signalled,
)
from parkade.services.scheduler.service import SchedulerHandler, SchedulingOptions

GROUP_ID = "parkade-scheduler"


async def run(bus: Bus, handler: SchedulerHandler, *, prefix: str, stop: asyncio.Event, ready=None) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parkade scheduler", description=__doc__)
    add_bus_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--max-in-flight", type=int, default=2, help="step plans out at once")
    args = parser.parse_args(argv)
    bootstrap = require_bootstrap(args, parser)
    exit_on_sigterm()
    options = SchedulingOptions(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        policy=args.scheduling_policy,
        max_in_flight=args.max_in_flight,
    )

    async def serve_forever(stop: asyncio.Event) -> None:
        await on_kafka(
            bootstrap,
            args.topic_prefix,
            "parkade-scheduler",
            lambda bus: run(
                bus,
                SchedulerHandler(options),
                prefix=args.topic_prefix,
                stop=stop,
                ready=announce_ready("scheduler"),
            ),
        )

    return run_until_signalled(serve_forever)
