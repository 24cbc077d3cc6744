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


def test_prompts_that_take_long_to_tokenize_go_aside_and_the_small_ones_are_served_meanwhile():
    """Without the bound by length (a tokenizer where none can be proven, or prompts that may
    fit), big prompts are tokenized on the worker thread: a small request sent after them is
    answered while they are, each of them is answered in the end (the exact count), a big
    prompt that fits (truncated) runs as it would inline, and one aborted while aside ends as
    aborted."""
    prefix, count = "aside.", 8  # inline, 0.7 s each: the small one would wait 5.6 s
    params = SamplingParams(temperature=0, max_tokens=4)

    async def main():
        bus = MemoryBus()
        async with (
            running_pipeline(bus, STORIES, prefix=prefix) as pipeline,
            Client(bus=bus, topic_prefix=prefix) as client,
        ):
            tokenizer = pipeline.tokenizer
            tokenizer.frontend.token_bound = None
            floods = [
                await client.submit(request_id=f"big-{i}", prompt=f"{i} " + BIG, sampling_params=params)
                for i in range(count)
            ]
            start = time.monotonic()
            small_id = await client.submit(prompt="Once upon a time", sampling_params=params)
            small = [e async for e in client.stream(small_id)]
            small_s = time.monotonic() - start
            aside_when_small_ended = len(tokenizer.aside)
            # A restart now must read the small request's events again, as the big ones' records:
            # the commit on the generated topic stays below them (it ended while they were aside).
            generated = bus.topics[topics.topic_name(topics.GENERATED, prefix)]
            decoder = topics.TopicDecoder(topics.GENERATED)
            first_event = min(
                r.offset
                for r in generated
                if any(e.request_id == small_id for e in getattr(decoder.decode(r.value), "events", ()))
            )
            waiting = {request_id.encode() for request_id in tokenizer.aside}
            assert waiting, "every big prompt was answered before the small one ended"
            held = tokenizer.low_watermarks()
            assert held[topics.GENERATED] <= first_event, (held, first_event)
            # The commit on the requests topic stays at or below the record of every big prompt
            # still aside (not only big-0's: under load it may be answered before the small one).
            requests = bus.topics[topics.topic_name(topics.REQUESTS, prefix)]
            assert held[topics.REQUESTS] <= min(r.offset for r in requests if r.key in waiting)
            flood = {rid: [e async for e in client.stream(rid)] for rid in floods}
            # A big prompt that fits once truncated to its last 8 tokens, against the same 8 ids.
            truncated = SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=8)
            ids = tokenizer.frontend.tokenizer.encode(BIG)[-8:]
            big = [e async for e in client.generate(prompt=BIG, sampling_params=truncated)]
            inline = [e async for e in client.generate(prompt_token_ids=ids, sampling_params=params)]
            # Aborted while aside: the abort waits for it, then ends it.
            aborted = await client.submit(request_id="aborted", prompt=BIG, sampling_params=truncated)
            await client.cancel(aborted)
            abort_events = [e async for e in client.stream(aborted)]
            return small_s, small, aside_when_small_ended, flood, big, inline, abort_events, tokenizer

    small_s, small, aside_then, flood, big, inline, aborted, tokenizer = asyncio.run(main())
    assert small[-1].finish_reason == "length" and small_s < ANSWER_WITHIN_S, small_s
    assert aside_then > 0, "the big prompts were not still being tokenized when the small one ended"
    for i, (request_id, events) in enumerate(flood.items()):
        assert len(events) == 1 and events[0].error_kind == "invalid_request", request_id
        tokens = len(tokenizer.frontend.tokenizer.encode(f"{i} " + BIG))
        assert f"your request has {tokens} input tokens" in events[0].error
    assert [t for e in big for t in e.token_ids] == [t for e in inline for t in e.token_ids]
    assert big[-1].usage.prompt_tokens == 8
    assert aborted[-1].finish_reason == "abort", aborted
    assert not tokenizer.aside and not tokenizer.low_watermarks().get(topics.REQUESTS)


def test_the_flood_benchmark_measures_each_mode():
    """loadtest/tokenizer_flood.py, small: every flood record answered, the small one too."""
    from loadtest_scripts import load_script

    bench = load_script("tokenizer_flood")
    for mode in bench.MODES:
        result = asyncio.run(bench.one_mode(mode, flood=2, chars=40_000))
        assert result["flood_refused"] == 2 and result["small_request_tokens"] == 4, (mode, result)
    assert bench.tokenizer_main.ASIDE_PROMPT_CHARS == 16_384  # what "inline" changed, put back
