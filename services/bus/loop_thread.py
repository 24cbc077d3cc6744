"""`LoopThread`: an event loop of its own on a thread, for a Kafka client whose requests must not
wait for the caller's loop.

Why: aiokafka's producer sends from a task of the loop it was made on, one produce request per
broker at a time, and reads each answer on that loop too. The gateway's loop takes a burst of
HTTP requests in long iterations (measured, 64 requests: 11.5 and 22.5 ms, one of 58.6 ms while
the executor held both cores), and its produce requests went out only between them, each
carrying every record queued since: requests reached the tokenizer 30-60 ms after the gateway.
On a loop of its own the producer runs whenever its thread gets the GIL back, which CPython hands
over within its switch interval (5 ms) of asking: 4-15 ms (docs/benchmarks.md, fifth session).

The caller's loop only hands coroutines over (`run`, `submit`) and awaits their results; every
object of the client lives on this loop and is touched only from its thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._closing = False
        # A daemon: a process that ends without `close` (a crash) is not held by it.
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Start `coro` on this thread's loop now; -> a future of the calling loop for its result.
        Cancelling that future cancels `coro`'s task."""
        if self._closing:
            coro.close()
            raise RuntimeError(f"{self._thread.name} is closed")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`, run on this thread's loop, awaited from the caller's."""
        return await self.submit(coro)

    def close(self, timeout_s: float = 2.0) -> None:
        """Cancel what still runs on the loop (its callers get CancelledError, never a wait
        without end), then stop the loop and its thread. Blocks the caller for as long: a few ms
        when the caller stopped its client first, `timeout_s` twice at most."""
        if self.loop.is_closed():
            return
        self._closing = True
        if self._thread.is_alive():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(_cancel_the_rest(timeout_s), self.loop).result(timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error(
                "%s did not stop within %.1f s; left to end with the process", self._thread.name, timeout_s
            )
        else:
            self.loop.close()


async def _cancel_the_rest(timeout_s: float) -> None:
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)
