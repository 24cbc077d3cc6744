"""`parkade.client.Client` on the in-memory bus: a stream never hangs and never takes another
request's events; a second stream of one id is refused; cancel never raises."""

from __future__ import annotations

import asyncio

import pytest

from parkade.client import Client, PipelineGoneError
from parkade.schemas import AbortRequest, FinishReason, SamplingParams, TokenEvent, TokenEventBatch, topics
from parkade.services.bus import MemoryBus
from parkade.services.bus import client as client_module

PREFIX = "t."
TOKENS = topics.topic_name(topics.TOKENS, PREFIX)
REQUESTS = topics.topic_name(topics.REQUESTS, PREFIX)


def request_traceparent(bus, request_id):
    """The trace context the client sent its request with."""
    decoder = topics.decoder(topics.REQUESTS)
    for record in bus.topics[REQUESTS]:
        if decoder.decode(record.value).request_id == request_id:
            return record.header("traceparent")
    raise AssertionError(request_id)


async def send_event(bus, event, traceparent):
    await bus.send(TOKENS, topics.ENCODER.encode(event), key=event.request_id.encode(),
                   headers=(("traceparent", traceparent),))  # fmt: skip


def test_events_of_another_request_with_the_same_id_do_not_reach_the_stream():
    async def main():
        bus = MemoryBus()
        async with Client(bus=bus, topic_prefix=PREFIX, own_reply_topic=False) as client:
            await client.submit(prompt="Hi", request_id="r")
            with pytest.raises(ValueError, match="being streamed by this client already"):
                await client.submit(prompt="Hi", request_id="r")
            mine = request_traceparent(bus, "r")
            duplicate = TokenEvent(request_id="r", index=0, finish_reason=FinishReason.ERROR, error="in use")
            await send_event(bus, duplicate, b"00-another-request")
            await send_event(bus, TokenEvent(request_id="r", index=0, token_ids=(5,), text="x"), mine)
            done = TokenEvent(request_id="r", index=1, token_ids=(6,), text="y", finish_reason="length")
            await send_event(bus, done, mine)
            return [e async for e in client.stream("r")]

    events = asyncio.run(main())
    assert [e.text for e in events] == ["x", "y"] and events[-1].finish_reason == "length"


def test_a_batch_of_events_reaches_each_stream_and_not_a_request_that_reuses_the_id():
    async def main():
        bus = MemoryBus()
        async with Client(bus=bus, topic_prefix=PREFIX) as client:
            await client.submit(prompt="Hi", request_id="r")
            await client.submit(prompt="Ho", request_id="s")
            (request,) = [r for r in bus.topics[REQUESTS] if r.key == b"r"]
            assert request.header(topics.REPLY_BATCHES) is not None  # it asks for batches
            mine = request_traceparent(bus, "r").decode()
            first = TokenEventBatch(
                events=(
                    TokenEvent(request_id="r", index=0, finish_reason=FinishReason.ERROR, error="in use"),
                    TokenEvent(request_id="r", index=0, token_ids=(5,), text="x"),
                    TokenEvent(request_id="s", index=0, token_ids=(7,), text="z", finish_reason="length"),
                ),
                traceparents=("00-another-request", mine, ""),  # "": no trace context to check
            )
            last = TokenEventBatch(
                events=(
                    TokenEvent(request_id="r", index=1, token_ids=(6,), text="y", finish_reason="length"),
                ),
                traceparents=(mine,),
            )
            for batch in (first, last):
                await bus.send(
                    client.reply_topic, topics.ENCODER.encode(batch), key=client.reply_topic.encode()
                )
            return [e.text async for e in client.stream("r")], [e.text async for e in client.stream("s")]

    assert asyncio.run(main()) == (["x", "y"], ["z"])


def test_a_request_past_its_timeout_ends_with_timeout_error_and_is_aborted():
    async def main():
        bus = MemoryBus()
        async with Client(bus=bus, topic_prefix=PREFIX) as client:
            with pytest.raises(TimeoutError, match="passed its timeout"):
                async for _ in client.generate(prompt="Hi", request_id="slow", timeout_s=0.2):
                    pass
        decoder = topics.decoder(topics.REQUESTS)
        return [decoder.decode(r.value) for r in bus.topics[REQUESTS]]

    sent = asyncio.run(main())
    assert sent[-1] == AbortRequest(request_id="slow")


def test_a_silent_pipeline_or_a_lost_broker_ends_the_stream_with_one_error(monkeypatch):
    monkeypatch.setattr(client_module, "PROBE_S", 0.05)

    class GoneBus(MemoryBus):
        gone = False

        async def ping(self, timeout_s):
            if self.gone:
                raise ConnectionError("nothing answered (injected)")

        async def queue_many(self, records):
            if self.gone:
                raise ConnectionError("nothing answered (injected)")
            return await super().queue_many(records)

    async def main():
        bus = GoneBus()
        async with Client(bus=bus, topic_prefix=PREFIX, idle_timeout_s=0.3) as client:
            with pytest.raises(PipelineGoneError, match=r"no event for request quiet in 0\.3 s"):
                async for _ in client.generate(prompt="Hi", request_id="quiet"):
                    pass
            request_id = await client.submit(prompt="Hi")
            bus.gone = True
            with pytest.raises(PipelineGoneError, match=r"lost the broker.*nothing answered"):
                async for _ in client.stream(request_id):
                    pass
            await client.cancel(request_id)  # the broker is gone: nothing to abort, no exception

    asyncio.run(main())


def test_a_stream_of_samples_ends_when_every_sample_finished_or_at_an_error():
    async def main():
        bus = MemoryBus()
        async with Client(bus=bus, topic_prefix=PREFIX, own_reply_topic=False) as client:
            params = SamplingParams(n=2)
            await client.submit(prompt="Hi", request_id="ok", sampling_params=params)
            await client.submit(prompt="Hi", request_id="bad", sampling_params=params)
            ok, bad = request_traceparent(bus, "ok"), request_traceparent(bus, "bad")
            for event in (
                TokenEvent(request_id="ok", index=0, token_ids=(5,), sample_index=1),
                TokenEvent(request_id="ok", index=0, token_ids=(5,), sample_index=0, finish_reason="length"),
                TokenEvent(request_id="ok", index=0, token_ids=(5,), sample_index=0),  # a late duplicate
                TokenEvent(request_id="ok", index=1, token_ids=(6,), sample_index=1, finish_reason="length"),
            ):
                await send_event(bus, event, ok)
            # Sample 0 ended, then the request failed: the error event (sample 0's) still ends it.
            first_done = TokenEvent(request_id="bad", index=0, sample_index=0, finish_reason="stop")
            await send_event(bus, first_done, bad)
            failed = TokenEvent(request_id="bad", index=1, finish_reason=FinishReason.ERROR, error="lost")
            await send_event(bus, failed, bad)
            return [e async for e in client.stream("ok")], [e async for e in client.stream("bad")]

    ok, bad = asyncio.run(main())
    assert [(e.sample_index, e.index) for e in ok] == [(1, 0), (0, 0), (1, 1)]
    assert bad[-1].error == "lost" and len(bad) == 2
