"""The three services on the in-memory bus: same messages and handlers as over Kafka."""

from __future__ import annotations

import asyncio

from hf_reference import STORIES
from pipeline import running_pipeline

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
