"""Run the three services in this process, on any bus, so tests can look inside them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from parkade.services.bus.base import Bus
from parkade.services.bus.serve import serve
from parkade.services.executor.main import ExecutorService, build_service
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.main import SchedulerService
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.main import TokenizerService


@dataclass
class Pipeline:
    tokenizer: TokenizerService
    scheduler: SchedulerService
    executor: ExecutorService

    @property
    def services(self) -> tuple[TokenizerService, SchedulerService, ExecutorService]:
        return (self.tokenizer, self.scheduler, self.executor)


@contextlib.asynccontextmanager
async def running_pipeline(
    bus: Bus,
    model: Path,
    *,
    prefix: str,
    options: SchedulingOptions | None = None,
    scheduler_kwargs: dict | None = None,
    metrics: bool = False,
    serve_tokenizer: bool = True,
    **executor_kwargs,
) -> AsyncIterator[Pipeline]:
    """The three services, built as their mains build them, serving on `bus` (`metrics`:
    measuring, as with --metrics-port; `serve_tokenizer=False`: the tokenizer is built but served
    by the caller, as a gateway with the tokenizer in its process does)."""
    executor_kwargs.setdefault("dtype", "float32")
    pipeline = Pipeline(
        # A simulated executor's model sets the tokenizer's length limit too.
        TokenizerService(
            FrontEnd.from_options(TokenizerOptions(model=model, simulate=executor_kwargs.get("simulate")))
        ),
        SchedulerService(options or SchedulingOptions(), **(scheduler_kwargs or {})),
        build_service(ExecutorOptions(model=model, **executor_kwargs), heartbeat_s=0.5),
    )
    if metrics:
        for service in pipeline.services:
            service.enable_metrics()
    stop = asyncio.Event()
    served = pipeline.services if serve_tokenizer else pipeline.services[1:]
    ready = [asyncio.Event() for _ in served]
    tasks = [
        asyncio.create_task(serve(bus, service, prefix=prefix, stop=stop, ready=event.set))
        for service, event in zip(served, ready, strict=True)
    ]
    body = asyncio.current_task()

    def on_end(task: asyncio.Task) -> None:
        # A service that fails while the body runs (nothing here restarts it: Tansu's
        # NOT_LEADER_OR_FOLLOWER, see tests/e2e/stack.py) ends the body at once, and the failure
        # is the service's error (raised below), not a timeout minutes later.
        if not stop.is_set() and not task.cancelled() and task.exception() is not None and body is not None:
            body.cancel()

    for task in tasks:
        task.add_done_callback(on_end)
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 30)
        yield pipeline
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def wait_idle(pipeline: Pipeline, timeout_s: float = 30.0) -> None:
    """Until the scheduler holds no request and no step is in flight."""
    for _ in range(int(timeout_s / 0.05)):
        scheduler = pipeline.scheduler
        if (
            scheduler.scheduler is not None
            and not scheduler.scheduler.requests
            and not scheduler.link.in_flight
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the scheduler did not become idle")
