"""The executor service: `parkade executor [--model DIR]`. Its only I/O edge.

NOTE: torch (the model, the handler) is imported when the handler is built, not with this module:
`parkade up` reads FLAGS here to pass the executor its settings, and starts without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import send_all, serve
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.executor.options import ExecutorOptions

if TYPE_CHECKING:
    from parkade.services.executor.handler import ExecutorHandler

log = logging.getLogger(__name__)

GROUP_ID = "parkade-executor"
HEARTBEAT_S = 5.0
# A step running this long is hung (a wedged device, a deadlock): the process exits, so that its
# supervisor starts a fresh executor, which the scheduler adopts and recomputes every request on.
# Heartbeats alone cannot tell: they come from the event loop, not from the step's thread.
STEP_DEADLINE_S = 300.0
EXIT_HUNG = 70
FLAGS = dataclass_flags(ExecutorOptions)


async def run(
    bus: Bus,
    handler: ExecutorHandler,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
    heartbeat_s: float = HEARTBEAT_S,
    step_deadline_s: float = STEP_DEADLINE_S,
    on_hung: Callable[[], None] = lambda: os._exit(EXIT_HUNG),
) -> None:
    loop = asyncio.get_running_loop()
    step_started: list[float | None] = [None]

    async def on_plan(message, record):
        # The forward pass runs off the event loop, so heartbeats keep going.
        step_started[0] = loop.time()
        try:
            return await asyncio.to_thread(handler.on_plan, message)
        finally:
            step_started[0] = None

    async def heartbeat() -> None:
        # NOTE: a failed send must not end the heartbeat: the scheduler would declare this
        # executor dead while it serves on.
        while True:
            started = step_started[0]
            if started is not None and loop.time() - started > step_deadline_s:
                hung_s = loop.time() - started
                log.critical("a step has run for %.0f s: hung; exiting, for a fresh executor", hung_s)
                on_hung()
                return
            try:
                await send_all(bus, [handler.announcement()], prefix)
            except Exception:
                log.warning("a heartbeat could not be sent; trying again in %g s", heartbeat_s, exc_info=True)
            await asyncio.sleep(heartbeat_s)

    beating = asyncio.create_task(heartbeat())
    try:
        await serve(
            bus,
            prefix=prefix,
            group_id=GROUP_ID,
            handlers={topics.STEP_PLANS: on_plan},
            stop=stop,
            ready=ready,
            poll_ms=10,
            send_each=True,  # result N goes out before step N+1 runs
            on_send_error=handler.on_send_error,
        metrics=handler.metrics,
        )
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


def build_handler(options: ExecutorOptions) -> ExecutorHandler:
    from parkade.services.executor.build import build_executor
    from parkade.services.executor.handler import ExecutorHandler

    model_config, executor, max_model_len = build_executor(options)
    return ExecutorHandler(
        executor,
        model=str(options.model),
        max_model_len=max_model_len,
        eos_token_ids=model_config.eos_token_ids,
    )


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("executor", __doc__)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    return run_service(
        "executor", parser, args, lambda: build_handler(ExecutorOptions(**flag_values(FLAGS, args))), run
    )
