"""A flood of prompts far too long for the model on the requests topic, through the real
tokenizer handler (and the rest of the pipeline) on the in-memory bus: each is refused from its
length alone, untokenized, so a small request sent after the flood is answered at once.

Before the refusal by length (tokenizer.json's longest token, `context.TokenLowerBound`), each
1 MB prompt was tokenized first (0.67 s on stories260K), and a request behind 200 of them
waited over two minutes."""

from __future__ import annotations

import asyncio
import os
import time

from hf_reference import STORIES
from pipeline import running_pipeline

from parkade import SamplingParams
from parkade.client import Client
from parkade.schemas import GenerateRequest, topics
from parkade.services.bus import MemoryBus

# The flood: 200 prompts of about 1 MB (PARKADE_FLOOD_PROMPTS to measure other sizes).
FLOOD = int(os.environ.get("PARKADE_FLOOD_PROMPTS", "200"))
BIG = "Once upon a time, " * 55_000  # 990,000 characters, about 240,000 tokens
ANSWER_WITHIN_S = 5.0


def flood_then_one(disable_bound: bool = False) -> tuple[float, list, list]:
    """-> (seconds from the small request's submission to its last event, its events, the
    flood's events)."""
    prefix = "flood."

    async def main():
        bus = MemoryBus()
        async with (
            running_pipeline(bus, STORIES, prefix=prefix) as pipeline,
            Client(bus=bus, topic_prefix=prefix) as client,
        ):
            if disable_bound:  # what the tokenizer did before: tokenize, then count
                pipeline.tokenizer.frontend.token_bound = None
            requests = topics.topic_name(topics.REQUESTS, prefix)
            for i in range(FLOOD):
                message = GenerateRequest(request_id=f"flood-{i}", prompt=BIG)
                await bus.send(requests, topics.encode(message), key=message.request_id.encode())
            start = time.monotonic()
            params = SamplingParams(temperature=0, max_tokens=4)
            events = [e async for e in client.generate(prompt="Once upon a time", sampling_params=params)]
            elapsed = time.monotonic() - start
            decoder = topics.TopicDecoder(topics.TOKENS)
            shared = bus.topics.get(topics.topic_name(topics.TOKENS, prefix), [])
            flood = [decoder.decode(r.value) for r in shared]
        return elapsed, events, flood

    return asyncio.run(main())


def test_a_small_request_after_a_flood_of_megabyte_prompts_is_answered_at_once():
    elapsed, events, flood = flood_then_one()
    assert events[-1].finish_reason == "length" and sum(len(e.token_ids) for e in events) == 4
    assert elapsed < ANSWER_WITHIN_S, f"answered {elapsed:.1f} s after a flood of {FLOOD} prompts"
    # Every flood record got its error event, with the count the bound proves.
    assert sorted(e.request_id for e in flood) == sorted(f"flood-{i}" for i in range(FLOOD))
    for event in flood:
        assert event.finish_reason == "error" and event.error_kind == "invalid_request"
        assert event.error == (
            "This model's maximum context length is 512 tokens. However, your request has at least "
            f"{-(-len(BIG) // 7)} input tokens. Please reduce the length of the input messages."
        )
