"""The three services on the in-memory bus: same messages and handlers as over Kafka."""

from __future__ import annotations

import asyncio

from hf_reference import STORIES
from leaks import mentions
from pipeline import running_pipeline, wait_idle

from parkade import LLM, SamplingParams
from parkade.client import Client
from parkade.services.bus import MemoryBus


def test_pipeline_streams_the_same_text_as_the_in_process_engine():
    prompts = ["Once upon a time", "Lily and Tom", "The big dog", "One day, a girl"]
    params = SamplingParams(temperature=0, max_tokens=30)
    expected = [
        o.outputs[0] for o in LLM(STORIES, dtype="float32", max_model_len=256).generate(prompts, params)
    ]

    async def main():
        bus = MemoryBus()
        async with (
            running_pipeline(bus, STORIES, prefix="t.", max_model_len=256),
            Client(bus=bus, topic_prefix="t.") as client,
        ):

            async def one(prompt):
                events = [e async for e in client.generate(prompt=prompt, sampling_params=params)]
                return events

            results = await asyncio.gather(*(one(p) for p in prompts))
        for events, exp in zip(results, expected, strict=True):
            assert [e.index for e in events if e.token_ids] == list(range(len(exp.token_ids)))
            assert [t for e in events for t in e.token_ids] == exp.token_ids
            assert "".join(e.text for e in events) == exp.text
            assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 30

    asyncio.run(main())


def test_overload_refuses_the_excess_at_once_and_leaves_no_state_behind():
    """Far more requests than the waiting bound: the excess is answered at once ("overloaded"),
    the rest complete, and nothing about any request is left in the three services afterwards
    (what remains is bounded: the recently finished ids)."""
    from parkade.services.common.recent import REMEMBER_FINISHED
    from parkade.services.scheduler.config import SchedulingOptions

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = SchedulingOptions(max_num_seqs=2, max_waiting_requests=6)

    async def main():
        bus = MemoryBus()
        async with (
            running_pipeline(bus, STORIES, prefix="t.", max_model_len=256, options=options) as pipeline,
            Client(bus=bus, topic_prefix="t.") as client,
        ):

            async def one(i):
                prompt = f"Once upon a time {i}"
                events = client.generate(prompt=prompt, sampling_params=params, request_id=f"r{i}")
                return [e async for e in events]

            results = await asyncio.gather(*(one(i) for i in range(60)))
            await wait_idle(pipeline)
            return pipeline, results

    pipeline, results = asyncio.run(main())
    done = [r for r in results if r[-1].finish_reason == "length"]
    refused = [r for r in results if r[-1].finish_reason == "error"]
    assert len(done) + len(refused) == 60 and len(done) >= options.max_waiting_requests and refused
    for events in refused:
        assert len(events) == 1 and events[0].error.startswith("overloaded: ")
        assert events[0].error_kind == "overloaded"  # the gateway answers 429
    assert all(sum(len(e.token_ids) for e in r) == 8 for r in done)
    tokenizer, scheduler = pipeline.tokenizer, pipeline.scheduler
    assert not tokenizer.streams and not tokenizer.orphans and not scheduler.live
    assert not scheduler.scheduler.requests and len(scheduler.live.finished) <= REMEMBER_FINISHED
    assert scheduler.scheduler.kv.num_free_blocks == scheduler.scheduler.kv.num_blocks
    # Nothing about any of the 60 requests is left anywhere in the three services but the
    # bounded memories of ended ids (whatever table a future change adds).
    ids = {f"r{i}" for i in range(60)}
    for service in pipeline.services:
        assert mentions(service, ids, skip=("finished",)) == [], type(service).__name__
    assert all(request_id in scheduler.live.finished for request_id in ids)


def test_a_service_that_fails_mid_test_ends_the_test_with_its_error_at_once():
    """The in-process pipeline restarts nothing: a service whose send fails (the broker's error)
    ends the test body at once with that error, rather than the body waiting out its timeout."""
    import time

    import pytest

    class BrokenBus(MemoryBus):
        broken = False

        async def queue_many(self, records):
            if self.broken and any(r.topic.endswith("step-plans") for r in records):
                raise ConnectionError("the broker went away (injected)")
            return await super().queue_many(records)

    params = SamplingParams(temperature=0, max_tokens=8)

    async def main():
        bus = BrokenBus()
        async with (
            running_pipeline(bus, STORIES, prefix="t.", max_model_len=256),
            Client(bus=bus, topic_prefix="t.") as client,
        ):
            bus.broken = True
            async for _ in client.generate(prompt="Once upon a time", sampling_params=params):
                pass  # the scheduler's plan cannot be sent: no answer comes

    started = time.monotonic()
    with pytest.raises(ConnectionError, match="injected"):
        asyncio.run(asyncio.wait_for(main(), 60))
    assert time.monotonic() - started < 30
