"""`LoopThread`: coroutines handed to a loop on its own thread, their results and errors back on
the caller's loop, cancellation passed on, and the thread gone after `close`."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from parkade.services.bus.loop_thread import LoopThread


@pytest.fixture
def thread():
    """A loop thread, closed after the test whatever it did."""
    loop_thread = LoopThread("test-loop")
    yield loop_thread
    loop_thread.close()


def test_a_coroutine_runs_on_the_thread_and_its_result_and_error_come_back(thread):
    async def where(fail: bool) -> int:
        if fail:
            raise KeyError("from the thread")
        return threading.get_ident()

    async def main():
        assert await thread.run(where(False)) not in (threading.get_ident(), None)
        with pytest.raises(KeyError, match="from the thread"):
            await thread.run(where(True))

    asyncio.run(main())


def test_work_goes_on_while_the_callers_loop_is_blocked(thread):
    """What the gateway's producer needs: a submitted coroutine gets on while the caller's loop
    runs a long iteration of other work (here, a blocking sleep)."""

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

    asyncio.run(main())


def test_cancelling_the_callers_future_cancels_the_task_on_the_thread(thread):
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

    asyncio.run(main())


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


def test_close_cancels_what_still_runs_so_that_no_caller_waits_forever():
    thread = LoopThread("test-loop-pending")

    async def main():
        pending = thread.submit(asyncio.sleep(3600))
        await asyncio.sleep(0.05)
        thread.close()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(pending, 5)

    asyncio.run(main())
    assert "test-loop-pending" not in {t.name for t in threading.enumerate()}


def test_a_bus_whose_producer_fails_to_stop_still_ends_its_thread():
    """`KafkaBus.close` bounded by a timeout (the gateway's client stop), or a producer whose
    stop raises: the thread ends all the same."""
    from aiokafka.errors import KafkaConnectionError

    from parkade.services.bus.kafka import KafkaBus

    class Stuck:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        async def stop(self) -> None:
            if self.fail:
                raise KafkaConnectionError("the broker is gone")
            await asyncio.sleep(3600)

    async def close(fail: bool, name: str) -> None:
        bus = KafkaBus("127.0.0.1:1", client_id=name, producer_thread=True)
        bus._loop_thread, bus._producer = LoopThread(f"{name}-producer"), Stuck(fail)
        if fail:
            with pytest.raises(KafkaConnectionError):
                await bus.close()
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(bus.close(), 0.2)
        assert f"{name}-producer" not in {t.name for t in threading.enumerate()}
        await bus.close()  # nothing left: no error

    asyncio.run(close(True, "failing"))
    asyncio.run(close(False, "stuck"))
