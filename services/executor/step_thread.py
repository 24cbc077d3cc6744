"""`StepThread`: every forward step of one engine on one thread of its own, off the event loop.

Why not `asyncio.to_thread`: it hands each call to whichever thread of asyncio's shared pool is
free, and an OpenMP team belongs to the thread that starts it. Steps spread over the pool's
threads ran on several teams, whose idle workers spun on the cores the running team needed (five
busy threads in the executor over one burst, three with this; docs/benchmarks.md, 2026-12-06,
sixteenth session). Used by the executor service and `AsyncLLM`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREAD_NAME_PREFIX = "parkade-step"


class StepThread:
    """The thread is made at the first `run` and ended by `close`; a `run` after that makes a
    new one."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the thread, in a copy of the caller's context (its trace span), as
        `asyncio.to_thread` runs it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX)
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def close(self) -> None:
        """Without waiting: a step under way (cancelled, or hung: see the executor's watchdog)
        still ends in its thread."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
