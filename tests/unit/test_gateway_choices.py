"""The gateway's `Choices`: the events of an HTTP request's choices in arrival order, and the
events that came already of the choice being streamed, taken early to share its chunk."""

from __future__ import annotations

import asyncio

from parkade.schemas import FinishReason, TokenEvent
from parkade.services.gateway.main import Choices


class Streams:
    """A RequestClient's `stream` and `abandon`, fed by hand: `put` events (or an error) of a request."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}

    def put(self, request_id: str, item: TokenEvent | Exception) -> None:
        self.queues.setdefault(request_id, asyncio.Queue()).put_nowait(item)

    async def stream(self, request_id: str):
        queue = self.queues.setdefault(request_id, asyncio.Queue())
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def abandon(self, request_id: str) -> None:
        pass


def event(request_id: str, index: int, token: int, **fields) -> TokenEvent:
    return TokenEvent(request_id=request_id, index=index, token_ids=(token,), text=f"<{token}>", **fields)


def run(test) -> None:
    async def main() -> None:
        streams = Streams()
        choices = Choices(streams, ["a", "b"], span=None)
        try:
            await asyncio.wait_for(test(streams, choices), 5)  # a lost event: next() waits forever
        finally:
            await choices.close()

    asyncio.run(main())


async def settle() -> None:
    for _ in range(5):  # the pump tasks move what was put
        await asyncio.sleep(0)


def test_events_that_came_already_are_taken_until_another_choice_comes_first():
    async def test(streams: Streams, choices: Choices) -> None:
        for item in (event("a", 0, 1), event("a", 1, 2), event("b", 0, 5), event("a", 2, 3)):
            streams.put(item.request_id, item)
            await settle()  # each moved to the choices before the next comes
        assert await choices.next() == (0, event("a", 0, 1))
        assert choices.ready_event(0, event("a", 0, 1)) == event("a", 1, 2)
        # b's event came before a's third: a's stops there, and b's is the next, not lost.
        assert choices.ready_event(0, event("a", 1, 2)) is None
        assert await choices.next() == (1, event("b", 0, 5))
        assert await choices.next() == (0, event("a", 2, 3))
        assert choices.ready_event(0, event("a", 2, 3)) is None  # nothing more came

    run(test)


def test_a_choices_last_event_taken_early_ends_it_and_an_error_is_never_taken_early():
    async def test(streams: Streams, choices: Choices) -> None:
        streams.put("a", event("a", 0, 1))
        streams.put("a", event("a", 1, 2, finish_reason=FinishReason.LENGTH))
        streams.put("b", event("b", 0, 5))
        await settle()
        first = await choices.next()
        assert choices.open == 2
        assert choices.ready_event(0, first[1]) == event("a", 1, 2, finish_reason=FinishReason.LENGTH)
        assert choices.open == 1  # a ended
        await choices.next()
        streams.put("b", TimeoutError("late"))
        await settle()
        assert choices.ready_event(1, event("b", 0, 5)) is None
        index, item = await choices.next()
        assert index == 1 and isinstance(item, TimeoutError) and choices.open == 0

    run(test)


def test_a_samples_events_are_taken_early_only_for_that_sample():
    async def test(streams: Streams, choices: Choices) -> None:
        # Request "b" (choices 2 and 3 of two samples each) interleaves its samples' events.
        for item in (event("b", 0, 1), event("b", 0, 7, sample_index=1), event("b", 1, 2)):
            streams.put("b", item)
        await settle()
        assert await choices.next() == (2, event("b", 0, 1))
        assert choices.ready_event(2, event("b", 0, 1)) is None  # sample 1's came first
        assert await choices.next() == (3, event("b", 0, 7, sample_index=1))
        assert await choices.next() == (2, event("b", 1, 2))

    async def main() -> None:
        streams = Streams()
        choices = Choices(streams, ["a", "b"], span=None, n=2)
        try:
            await asyncio.wait_for(test(streams, choices), 5)
        finally:
            await choices.close()

    asyncio.run(main())
