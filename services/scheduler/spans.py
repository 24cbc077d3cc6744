"""The scheduler's spans of each live request (see `services/common/tracing.py`): its life in
the scheduler, and its time in the queue, with admissions, preemptions, the first token and the
finish as events. Kept only while tracing is on."""

from __future__ import annotations

from typing import Any

from parkade.schemas import GeneratedTokens, StepPlan
from parkade.services.common import tracing


class RequestSpans:
    def __init__(self) -> None:
        self.request: dict[str, Any] = {}  # request_id -> scheduler.request span
        self.queue: dict[str, Any] = {}  # request_id -> scheduler.queue span, until admitted
        self.first_token_seen: set[str] = set()

    def arrived(
        self, request_id: str, headers: tuple[tuple[str, bytes], ...], num_prompt_tokens: int
    ) -> None:
        if not tracing.enabled() or request_id in self.request:
            return
        tracer = tracing.tracer()
        attributes = {"parkade.request_id": request_id, "parkade.prompt_tokens": num_prompt_tokens}
        span = tracer.start_span(
            "scheduler.request", context=tracing.context_of(headers), attributes=attributes
        )
        self.request[request_id] = span
        self.queue[request_id] = tracer.start_span(
            "scheduler.queue", context=tracing.trace.set_span_in_context(span), attributes=attributes
        )

    def traceparent(self, request_id: str) -> str:
        span = self.request.get(request_id)
        return (tracing.traceparent_of(span) or "") if span is not None else ""

    def planned(self, plan: StepPlan) -> None:
        if not self.request:
            return
        for new in plan.new_requests:
            span = self.request.get(new.request_id)
            if span is None:
                continue
            queue = self.queue.pop(new.request_id, None)
            if queue is not None:
                queue.set_attribute("parkade.prefix_cache_hit_tokens", new.num_computed_tokens)
                queue.end()
                span.add_event("admitted", {"parkade.prefix_cache_hit_tokens": new.num_computed_tokens})
            else:
                span.add_event("resumed", {"parkade.num_tokens": len(new.token_ids)})
        for request_id in plan.preempted_request_ids:
            span = self.request.get(request_id)
            if span is not None:
                span.add_event("preempted")

    def generated(self, event: GeneratedTokens) -> None:
        span = self.request.get(event.request_id)
        if span is None:
            return
        if event.token_ids and event.request_id not in self.first_token_seen:
            self.first_token_seen.add(event.request_id)
            span.add_event("first_token")
        if event.finish_reason is not None:
            queue = self.queue.pop(event.request_id, None)
            if queue is not None:
                queue.end()
            self.first_token_seen.discard(event.request_id)
            del self.request[event.request_id]
            span.set_attribute("parkade.finish_reason", str(event.finish_reason))
            span.set_attribute("parkade.output_tokens", event.index + len(event.token_ids))
            if event.error is not None:
                span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, event.error))
            span.add_event("finished", {"parkade.finish_reason": str(event.finish_reason)})
            span.end()
