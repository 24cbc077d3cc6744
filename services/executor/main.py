"""The executor service: `parkade executor [--model DIR]`. Its only I/O edge.

NOTE: torch (the model) is imported when the service is built, not with this module:
`parkade up` reads FLAGS here to pass the executor its settings, and starts without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parkade.schemas import StepPlan
from parkade.schemas.routing import DEFAULT_REPLICA, check_replica_name
from parkade.services.bus.base import Bus, Outgoing, Record
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import send_all
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.executor.handler import ExecutorHandler
from parkade.services.executor.options import ExecutorOptions
from parkade.services.executor.step_thread import StepThread

if TYPE_CHECKING:
    from parkade.services.executor.executor import Executor
    from parkade.services.executor.simulated import SimulatedExecutor

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
# A step running this long is hung (a wedged device, a deadlock): the process exits, so that its
# supervisor starts a fresh executor, which the scheduler adopts and recomputes every request on.
# Heartbeats alone cannot tell: they come from the event loop, not from the step's thread.
STEP_DEADLINE_S = 300.0
EXIT_HUNG = 70
FLAGS = dataclass_flags(ExecutorOptions)


class ExecutorService(ExecutorHandler):
    """The handler with its I/O: the forward pass off the event loop (so that heartbeats keep
    going), an announcement every `heartbeat_s`, and the hung-step watchdog."""

    def __init__(
        self,
        executor: Executor | SimulatedExecutor,
        *,
        max_model_len: int,
        heartbeat_s: float = HEARTBEAT_S,
        step_deadline_s: float = STEP_DEADLINE_S,
        on_hung: Callable[[], None] = lambda: os._exit(EXIT_HUNG),
        replica: str = DEFAULT_REPLICA,
    ) -> None:
        super().__init__(executor, max_model_len=max_model_len, replica=replica)
        if replica != DEFAULT_REPLICA:
            self.instance_name = f"executor.replica-{replica}"
        self.heartbeat_s, self.step_deadline_s, self.on_hung = heartbeat_s, step_deadline_s, on_hung
        self.step_started: float | None = None  # loop time, while a step runs
        self._beating: asyncio.Task | None = None
        self._step_thread = StepThread()  # every step on one thread of its own (see its module)

    async def start(self, bus: Bus, prefix: str) -> None:
        self._beating = asyncio.create_task(self._heartbeat(bus, prefix))

    async def stop(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beating
        self._step_thread.close()

    async def on_record(self, message: StepPlan, record: Record) -> list[Outgoing]:
        self.step_started = asyncio.get_running_loop().time()
        try:
            return await self._step_thread.run(self.on_plan, message)
        finally:
            self.step_started = None

    async def _heartbeat(self, bus: Bus, prefix: str) -> None:
        # NOTE: a failed send must not end the heartbeat: the scheduler would declare this
        # executor dead while it serves on.
        loop = asyncio.get_running_loop()
        while True:
            started = self.step_started
            if started is not None and loop.time() - started > self.step_deadline_s:
                hung_s = loop.time() - started
                log.critical("a step has run for %.0f s: hung; exiting, for a fresh executor", hung_s)
                self.on_hung()
                return
            try:
                await send_all(bus, [self.announcement()], prefix)
            except Exception:
                log.warning(
                    "a heartbeat could not be sent; trying again in %g s", self.heartbeat_s, exc_info=True
                )
            await asyncio.sleep(self.heartbeat_s)


def build_service(options: ExecutorOptions, **kwargs: Any) -> ExecutorService:
    """Load the model and allocate the KV pool (torch is imported here, unless simulating)."""
    from parkade.services.executor.build import build_executor

    executor, max_model_len = build_executor(options, environ=os.environ)
    return ExecutorService(executor, max_model_len=max_model_len, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("executor", __doc__, replica=True)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)

    def build() -> ExecutorService:
        replica = check_replica_name(args.replica)
        return build_service(ExecutorOptions(**flag_values(FLAGS, args)), replica=replica)

    return run_service("executor", parser, args, build)
