"""Each service's Prometheus metrics move as a request goes through (the in-memory bus; the
registries are read as a scrape reads them)."""

from __future__ import annotations

import asyncio

from hf_reference import STORIES
from pipeline import running_pipeline, wait_idle
from prometheus_client.parser import text_string_to_metric_families

from parkade import SamplingParams
from parkade.client import Client
from parkade.services.bus import MemoryBus


def scrape(metrics) -> dict[str, float]:
    """Sample name (with its labels) -> value, as Prometheus would read it."""
    out = {}
    for family in text_string_to_metric_families(metrics.text().decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def test_a_request_moves_the_running_gauge_then_the_latency_histograms():
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        bus = MemoryBus()
        async with running_pipeline(bus, STORIES, prefix="m.", max_model_len=256, metrics=True) as pipeline:
            scheduler, executor = pipeline.scheduler.metrics, pipeline.executor.metrics
            tokenizer = pipeline.tokenizer.metrics
            before = scrape(scheduler)
            async with Client(bus=bus, topic_prefix="m.") as client:
                request_id = await client.submit(prompt="Once upon a time", sampling_params=params)
                stream = client.stream(request_id)
                first = await anext(stream)
                during = scrape(scheduler)
                rest = [e async for e in stream]
            await wait_idle(pipeline)
            return before, during, scrape(scheduler), scrape(executor), scrape(tokenizer), [first, *rest]

    before, during, after, executor, tokenizer, events = asyncio.run(main())
    assert sum(len(e.token_ids) for e in events) == 40
    assert before["parkade:num_requests_running"] == 0
    assert during["parkade:num_requests_running"] == 1 and during["parkade:kv_cache_usage_perc"] > 0
    assert during["parkade:time_to_first_token_seconds_count"] == 1
    assert during["parkade:e2e_request_latency_seconds_count"] == 0
    assert after["parkade:num_requests_running"] == 0 and after["parkade:kv_cache_usage_perc"] == 0
    assert after["parkade:e2e_request_latency_seconds_count"] == 1
    assert after["parkade:request_queue_time_seconds_count"] == 1
    assert after["parkade:inter_token_latency_seconds_count"] == 39
    assert after["parkade:generation_tokens_total"] == 40 and after["parkade:prompt_tokens_total"] == 5
    assert after["parkade:prefix_cache_queries_total"] == 5
    assert after["parkade:iteration_tokens_total_count"] >= 40
    assert after["parkade:step_round_trip_seconds_count"] >= 40
    assert executor["parkade:step_time_seconds_count"] >= 40 and executor["parkade:steps_total"] >= 40
    assert tokenizer["parkade:tokenizer_requests_total"] == 1
    # Every consumer's lag, by topic: all read by now.
    assert after["parkade:consumer_lag{topic=m.step-results}"] == 0
    assert tokenizer["parkade:consumer_lag{topic=m.generated}"] == 0
