"""The scheduler's spans of each live request (see `services/common/tracing.py`): its life in
the scheduler, and its time in the queue, with admissions, preemptions, the first token and the
finish as events. They live on the request's `LiveRequest`, only while tracing is on."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from parkade.schemas import GeneratedTokens, NewRequestData, StepPlan
from parkade.services.common import tracing
from parkade.services.scheduler.live import LiveRequest


def arrived(record: LiveRequest, num_prompt_tokens: int) -> None:
    """Its record was read: the request's span and its queue span start (once)."""
    if not tracing.enabled() or record.span is not None:
        return
    tracer = tracing.tracer()
    attributes = {"parkade.request_id": record.request_id, "parkade.prompt_tokens": num_prompt_tokens}
    span = tracer.start_span(
        "scheduler.request", context=tracing.context_of(record.headers), attributes=attributes
    )
    record.span = span
    record.queue_span = tracer.start_span(
        "scheduler.queue", context=tracing.trace.set_span_in_context(span), attributes=attributes
    )


def traced(plan: StepPlan, live: Mapping[str, LiveRequest]) -> StepPlan:
    """The plan with its new requests' trace context, for the executor's spans (tracing on)."""
    if not plan.new_requests or not tracing.enabled():
        return plan
    return msgspec.structs.replace(plan, new_requests=tuple(_traced(new, live) for new in plan.new_requests))


def _traced(new: NewRequestData, live: Mapping[str, LiveRequest]) -> NewRequestData:
    record = live.get(new.request_id)
    if record is None or record.span is None:
        return new
    return msgspec.structs.replace(new, traceparent=tracing.traceparent_of(record.span) or "")


def planned(plan: StepPlan, live: Mapping[str, LiveRequest]) -> None:
    if not tracing.enabled():
        return
    for new in plan.new_requests:
        record = live.get(new.request_id)
        if record is None or record.span is None:
            continue
        if record.queue_span is not None:
            record.queue_span.set_attribute("parkade.prefix_cache_hit_tokens", new.num_computed_tokens)
            record.queue_span.end()
            record.queue_span = None
            record.span.add_event("admitted", {"parkade.prefix_cache_hit_tokens": new.num_computed_tokens})
        else:
            record.span.add_event("resumed", {"parkade.num_tokens": len(new.token_ids)})
    for request_id in plan.preempted_request_ids:
        record = live.get(request_id)
        if record is not None and record.span is not None:
            record.span.add_event("preempted")


def generated(record: LiveRequest, event: GeneratedTokens) -> None:
    span = record.span
    if span is None:
        return
    if event.token_ids and not record.first_token_seen:
        record.first_token_seen = True
        span.add_event("first_token")
    if event.finish_reason is None:
        return
    if record.queue_span is not None:
        record.queue_span.end()
        record.queue_span = None
    span.set_attribute("parkade.finish_reason", str(event.finish_reason))
    span.set_attribute("parkade.output_tokens", event.index + len(event.token_ids))
    if event.error is not None:
        span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, event.error))
    span.add_event("finished", {"parkade.finish_reason": str(event.finish_reason)})
    span.end()
    record.span = None
