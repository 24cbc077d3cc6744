"""The gateway's own metrics, in Prometheus' text format (`GET /metrics`): requests by endpoint
and status, requests in flight, token counts and latency histograms as the gateway sees them
(from the request's arrival at the gateway). The pipeline's services have their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few milliseconds (a warm prefix) to minutes (a long generation in a queue).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "parkade:gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.running = Gauge("parkade:gateway_requests_running", "requests being answered", registry=r)
        self.prompt_tokens = Counter("parkade:gateway_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("parkade:gateway_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(
            "parkade:gateway_time_to_first_token_seconds",
            "from the request's arrival to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "parkade:gateway_inter_token_latency_seconds",
            "between successive token events of a request, per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "parkade:gateway_e2e_request_latency_seconds",
            "from the request's arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)
