"""`LoopThread`: an event loop of its own on a thread, for a Kafka client whose requests must not
wait for the caller's loop.

Why: aiokafka's producer sends from a task of the loop it started on, one produce request per
broker at a time, and reads each answer on that loop too. On the gateway's loop, which handles a
burst of HTTP requests in iterations of 10-60 ms each (measured: 64 requests in two to five
iterations), a record queued in the first iteration went out only once the loop came round
again, and every record queued meanwhile waited for the answer after it: requests that reached
the gateway in its first 20 ms reached the tokenizer 30-60 ms later. On a loop of its own the
producer runs whenever its thread gets the GIL back, which CPython hands over within its switch
interval (5 ms) of asking.

The caller's loop only hands coroutines over (`run`, `submit`) and awaits their results; every
object of the client lives on this loop and is touched only from its thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        # A daemon: a process that ends without `close` (a crash) is not held by it.
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Start `coro` on this thread's loop now; -> a future of the calling loop for its result.
        Cancelling that future cancels `coro`'s task."""
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError(f"{self._thread.name} is closed")
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`, run on this thread's loop, awaited from the caller's."""
        return await self.submit(coro)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and its thread. The caller has stopped what runs on it first."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
