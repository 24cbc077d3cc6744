"""One request's trace across a real broker: spans of the tokenizer, the scheduler and the
executor under the request's trace id, with the right parents and links (an in-memory exporter;
the services run as tasks of this process, as in test_pipeline.py)."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest
from hf_reference import STORIES
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pipeline import running_pipeline, wait_idle
from stack import TANSU_NOT_LEADER

from parkade import SamplingParams
from parkade.client import Client
from parkade.schemas import GenerateRequest, topics
from parkade.services.bus.kafka import KafkaBus
from parkade.services.common import tracing

pytestmark = [pytest.mark.e2e, TANSU_NOT_LEADER]


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(None)


def test_one_requests_spans_from_every_service_share_its_trace(bootstrap_servers, spans):
    trace_id, root = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    prefix = f"tr{uuid.uuid4().hex[:8]}."

    async def main():
        bus = KafkaBus(bootstrap_servers, client_id="e2e-tracing")
        await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
        try:
            async with running_pipeline(bus, STORIES, prefix=prefix, max_model_len=256, block_size=16) as p:
                async with Client(bootstrap_servers, prefix) as client:
                    params = SamplingParams(temperature=0, max_tokens=6)
                    traceparent = f"00-{trace_id}-{root}-01".encode()
                    request_id = await client.submit(prompt="Once upon a time", sampling_params=params,
                                                     traceparent=traceparent)  # fmt: skip
                    events = [e async for e in client.stream(request_id)]
                    # A request from a client that sends no trace context (kcat, plain Kafka).
                    plain = GenerateRequest(request_id="plain", prompt="Lily", sampling_params=params)
                    await bus.send(f"{prefix}requests", msgspec.msgpack.encode(plain), key=b"plain")
                await wait_idle(p)
                await asyncio.sleep(0.2)  # the tokenizer's last span ends as its last event goes
                return events
        finally:
            await bus.close()

    events = asyncio.run(main())
    assert events[-1].finish_reason == "length"
    mine = [s for s in spans.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    by_name = {s.name: s for s in mine}
    assert set(by_name) == {
        "tokenize", "route", "scheduler.request", "scheduler.queue", "executor.prefill", "detokenize"
    }, sorted(s.name for s in mine)  # fmt: skip
    parent = {name: f"{s.parent.span_id:016x}" for name, s in by_name.items()}
    request_span = f"{by_name['scheduler.request'].context.span_id:016x}"
    assert parent["tokenize"] == parent["detokenize"] == parent["scheduler.request"] == root
    assert parent["route"] == root and by_name["route"].attributes["parkade.replica"] == "0"
    assert parent["scheduler.queue"] == parent["executor.prefill"] == request_span
    assert by_name["scheduler.queue"].attributes["parkade.prefix_cache_hit_tokens"] == 0
    assert [e.name for e in by_name["scheduler.request"].events] == ["admitted", "first_token", "finished"]
    assert by_name["detokenize"].attributes["parkade.output_tokens"] == 6
    # Every step that served the request is linked to its span, in the step's own trace.
    steps = [
        s for s in spans.get_finished_spans()
        if s.name == "executor.step" and any(f"{k.context.span_id:016x}" == request_span for k in s.links)
    ]  # fmt: skip
    assert len(steps) >= 6 and all(s.attributes["parkade.num_seqs"] == 1 for s in steps)
    assert all(f"{s.context.trace_id:032x}" != trace_id for s in steps)
    # Without a context from its client, a request's trace starts at the tokenizer: still one.
    plain = [s for s in spans.get_finished_spans() if s.attributes.get("parkade.request_id") == "plain"]
    plain_traces = {f"{s.context.trace_id:032x}" for s in plain}
    assert len(plain_traces) == 1
    names = {s.name for s in plain}
    assert names == {
        "tokenize",
        "route",
        "scheduler.request",
        "scheduler.queue",
        "executor.prefill",
        "detokenize",
    }
    # Nothing is recorded once tracing is off again.
    tracing.install(None)
    assert not tracing.start_span("x").is_recording()
