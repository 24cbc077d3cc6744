"""`LoopThread`: coroutines handed to a loop on its own thread, their results and errors back on
the caller's loop, cancellation passed on, and the thread gone after `close`."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from parkade.services.bus.loop_thread import LoopThread


def test_a_coroutine_runs_on_the_thread_and_its_result_and_error_come_back():
    thread = LoopThread("test-loop")

    async def where(fail: bool) -> int:
        if fail:
            raise KeyError("from the thread")
        return threading.get_ident()

    async def main():
        assert await thread.run(where(False)) not in (threading.get_ident(), None)
        with pytest.raises(KeyError, match="from the thread"):
            await thread.run(where(True))

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_work_goes_on_while_the_callers_loop_is_blocked():
    """What the gateway's producer needs: a submitted coroutine gets on while the caller's loop
    runs a long iteration of other work (here, a blocking sleep)."""
    thread = LoopThread("test-loop")

    async def main():
        progress: list[float] = []

        async def ticks():
            for _ in range(5):
                progress.append(time.monotonic())
                await asyncio.sleep(0.01)

        future = thread.submit(ticks())
        time.sleep(0.3)  # the caller's loop does not come round meanwhile
        assert len(progress) == 5
        await future

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_cancelling_the_callers_future_cancels_the_task_on_the_thread():
    thread = LoopThread("test-loop")
    started, cancelled = threading.Event(), threading.Event()

    async def forever():
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        future = thread.submit(forever())
        assert await asyncio.to_thread(started.wait, 5)
        future.cancel()
        with pytest.raises(asyncio.CancelledError):
            await future
        assert await asyncio.to_thread(cancelled.wait, 5)

    try:
        asyncio.run(main())
    finally:
        thread.close()


def test_close_ends_the_thread_and_later_work_is_refused():
    thread = LoopThread("test-loop-closing")
    thread.close()
    thread.close()  # twice: nothing to do
    assert "test-loop-closing" not in {t.name for t in threading.enumerate()}

    async def nothing():
        return None

    coro = nothing()
    with pytest.raises(RuntimeError, match="closed"):
        thread.submit(coro)
    assert coro.cr_frame is None  # closed, not left unawaited
