"""Run the three services in this process, on any bus, so tests can look inside them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from parkade.services.bus.base import Bus
from parkade.services.executor import main as executor_main
from parkade.services.executor.handler import ExecutorHandler
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler import main as scheduler_main
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.handler import SchedulerHandler
from parkade.services.tokenizer import main as tokenizer_main
from parkade.services.tokenizer.frontend import TokenizerOptions
from parkade.services.tokenizer.handler import TokenizerHandler


@dataclass
class Pipeline:
    tokenizer: TokenizerHandler
    scheduler: SchedulerHandler
    executor: ExecutorHandler


@contextlib.asynccontextmanager
async def running_pipeline(
    bus: Bus,
    model: Path,
    *,
    prefix: str,
    options: SchedulingOptions | None = None,
    scheduler_kwargs: dict | None = None,
    metrics: bool = False,
    **executor_kwargs,
) -> AsyncIterator[Pipeline]:
    """The three handlers, built as the services' mains build them, serving on `bus`
    (`metrics`: measuring, as with --metrics-port)."""
    executor_kwargs.setdefault("dtype", "float32")
    pipeline = Pipeline(
        tokenizer_main.build_handler(TokenizerOptions(model=model)),
        SchedulerHandler(options or SchedulingOptions(), **(scheduler_kwargs or {})),
        executor_main.build_handler(ExecutorOptions(model=model, **executor_kwargs)),
    )
    if metrics:
        for handler in (pipeline.tokenizer, pipeline.scheduler, pipeline.executor):
            handler.enable_metrics()
    stop = asyncio.Event()
    ready = [asyncio.Event() for _ in range(3)]
    tasks = [
        asyncio.create_task(
            tokenizer_main.run(bus, pipeline.tokenizer, prefix=prefix, stop=stop, ready=ready[0].set)
        ),
        asyncio.create_task(
            scheduler_main.run(bus, pipeline.scheduler, prefix=prefix, stop=stop, ready=ready[1].set)
        ),
        asyncio.create_task(
            executor_main.run(
                bus, pipeline.executor, prefix=prefix, stop=stop, ready=ready[2].set, heartbeat_s=0.5
            )
        ),
    ]
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
        if scheduler.scheduler is not None and not scheduler.scheduler.requests and not scheduler.in_flight:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the scheduler did not become idle")
