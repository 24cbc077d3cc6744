"""Tracing with OpenTelemetry: one trace per request, its context in W3C `traceparent` headers.

Every service calls `configure(service, environ)` once (from its main.py, which owns the
environment). Tracing is on when the environment asks for it:

    OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT   OTLP over HTTP (a collector)
    OTEL_TRACES_EXPORTER=otlp | console                                 the standard switch
    PARKADE_TRACE_FILE=path                                             JSON lines (`parkade up --trace`)

and off otherwise, or with OTEL_SDK_DISABLED=true. Off, `tracer()` is OpenTelemetry's no-op
tracer: a span costs a call and records nothing. The other OTEL_* variables (service name,
resource attributes, batch sizes, sampler) work as the SDK documents them.

A request's spans, by service (the root is the client's or the gateway's, from `traceparent`):

    tokenizer   tokenize                 the prompt becomes an EngineRequest
                detokenize               first generated tokens .. the last token event
    scheduler   scheduler.request        arrival .. finish; events: admitted (prefix-cache hit
                                         tokens), preempted, resumed, first_token, finished
                  scheduler.queue        arrival .. first admission
    executor    executor.prefill         the step that computed the request's prompt
                executor.step            one per step, linked to every request it served
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_TRUE = ("1", "true", "yes")
# NOTE: our own, not OpenTelemetry's global provider, which can be set once per process: tests
# install theirs and take it away again. None: tracing is off.
_provider: Any | None = None


def enabled() -> bool:
    return _provider is not None


def install(provider: Any | None) -> None:
    """Trace with `provider` from now on (`configure` does; tests pass their own); None: stop."""
    global _provider
    _provider = provider


def tracing_requested(environ: Mapping[str, str]) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() in _TRUE:
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":  # the standard off switch (OTLP settings may be for other signals)
        return bool(environ.get("PARKADE_TRACE_FILE"))
    return bool(
        environ.get("PARKADE_TRACE_FILE")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or exporter in ("otlp", "console")
    )


def configure(service: str, environ: Mapping[str, str]) -> Any | None:
    """Install a tracer provider for `service` if the environment asks for tracing; -> it, or None."""
    if not tracing_requested(environ):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = environ.get("OTEL_SERVICE_NAME") or f"parkade-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if environ.get("PARKADE_TRACE_FILE"):
        provider.add_span_processor(
            BatchSpanProcessor(JsonLinesExporter(Path(environ["PARKADE_TRACE_FILE"])))
        )
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif exporter != "none" and (
        exporter == "otlp"
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # reads OTEL_EXPORTER_OTLP_*
    install(provider)
    return provider


def shutdown() -> None:
    """Flush what is buffered (at a service's clean stop)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return _provider.get_tracer("parkade") if _provider is not None else trace.get_tracer("parkade")


def start_span(name: str, headers: Sequence[tuple[str, bytes]] = (), **kwargs: Any) -> trace.Span:
    """A span whose parent is the context in `headers`; tracing off, a span that does nothing
    (and nothing is parsed)."""
    if _provider is None:
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=context_of(headers), **kwargs)


def context_of(headers: Sequence[tuple[str, bytes]]) -> Context | None:
    """The trace context a record's `traceparent` header carries (None: none)."""
    value = next((v for k, v in headers if k == "traceparent"), None)
    return context_of_traceparent(value.decode(errors="replace")) if value else None


def carries_context(headers: Sequence[tuple[str, bytes]]) -> bool:
    """Whether the headers hold a valid W3C trace context (not merely a `traceparent` header)."""
    context = context_of(headers)
    return context is not None and trace.get_current_span(context).get_span_context().is_valid


def context_of_traceparent(traceparent: str | None) -> Context | None:
    if not traceparent:
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def traceparent_of(span: trace.Span) -> str | None:
    """The W3C traceparent of `span` (None for a span that records nothing)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def link_to(traceparent: str | None) -> list[trace.Link]:
    context = context_of_traceparent(traceparent)
    span_context = trace.get_current_span(context).get_span_context() if context is not None else None
    return [trace.Link(span_context)] if span_context is not None and span_context.is_valid else []


class JsonLinesExporter:
    """Spans as JSON lines in a file (appended; several processes may share it): what
    `parkade trace` reads."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = [json.dumps(span_record(span)) for span in spans]
        with self.path.open("a") as out:  # one write per batch: lines of processes do not interleave
            out.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_record(span: Any) -> dict[str, Any]:
    """A finished SDK span as plain JSON."""
    context, parent = span.context, span.parent
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [f"{link.context.trace_id:032x}-{link.context.span_id:016x}" for link in span.links],
    }
