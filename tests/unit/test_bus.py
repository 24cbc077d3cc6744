"""The consume loop's delivery semantics, on the in-memory bus."""

from __future__ import annotations

import asyncio

import msgspec

from parkade.schemas import AbortRequest, topics
from parkade.services.bus import MemoryBus
from parkade.services.bus.serve import serve

PREFIX = "t."
REQUESTS = topics.topic_name(topics.REQUESTS, PREFIX)
DEAD = topics.topic_name(topics.DEAD_LETTER, PREFIX)


def abort(request_id: str) -> bytes:
    return msgspec.msgpack.encode(AbortRequest(request_id=request_id))


async def _serve_until(bus, handler, until, **kwargs):
    stop = asyncio.Event()
    task = asyncio.create_task(
        serve(bus, prefix=PREFIX, group_id="g", handlers={topics.REQUESTS: handler}, stop=stop, **kwargs)
    )
    await until()
    stop.set()
    await task


def test_a_batch_is_committed_only_after_its_handler_succeeded():
    async def main():
        bus = MemoryBus()
        for request_id in ("a", "b"):
            await bus.send(REQUESTS, abort(request_id))
        handled, blocked = [], asyncio.Event()

        async def stuck(message, record):  # the service dies while handling the batch
            handled.append(message.request_id)
            await blocked.wait()
            return []

        crashed = asyncio.create_task(
            serve(bus, prefix=PREFIX, group_id="g", handlers={topics.REQUESTS: stuck}, stop=asyncio.Event())
        )
        while not handled:
            await asyncio.sleep(0.01)
        crashed.cancel()
        again = []

        async def until_two():
            while len(again) < 2:
                await asyncio.sleep(0.01)

        await _serve_until(bus, lambda m, r: again.append(m.request_id) or [], until_two)
        assert again == ["a", "b"]  # redelivered to the group's next consumer
        rest = []
        await _serve_until(bus, lambda m, r: rest.append(m) or [], lambda: asyncio.sleep(0.2))
        assert rest == []  # committed: not delivered a third time

    asyncio.run(main())


def test_undecodable_records_and_failing_handlers_go_to_the_dead_letter_topic():
    async def main():
        bus = MemoryBus()
        await bus.send(REQUESTS, b"\xc1 junk")
        await bus.send(REQUESTS, abort("boom"))
        await bus.send(REQUESTS, abort("fine"))
        seen = []

        def handler(message, record):
            if message.request_id == "boom":
                raise RuntimeError("handler bug")
            seen.append(message.request_id)
            return []

        async def until_fine():
            while not seen:
                await asyncio.sleep(0.01)

        await _serve_until(bus, handler, until_fine)
        letters = bus.topics[DEAD]
        assert [r.value for r in letters] == [b"\xc1 junk", abort("boom")]
        assert b"handler bug" in letters[1].header("parkade-error")
        assert seen == ["fine"]  # the records behind them are not held up

    asyncio.run(main())
