"""The gateway's own metrics, in Prometheus' text format (`GET /metrics`): requests by endpoint
and status, requests in flight, token counts and latency histograms as the gateway sees them
(from the request's arrival at the gateway). The pipeline's services have their own."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from parkade.services.common.metrics import LATENCY_BUCKETS, SHORT_BUCKETS, ServiceMetrics


class GatewayMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter(
            "parkade:gateway_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.running = Gauge("parkade:gateway_requests_running", "requests being answered", registry=r)
        self.prompt_tokens = Counter("parkade:gateway_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter("parkade:gateway_generation_tokens", "generated tokens", registry=r)
        self.ttft = self.histogram(
            "parkade:gateway_time_to_first_token_seconds",
            "from the request's arrival to its first token",
            LATENCY_BUCKETS,
        )
        self.itl = self.histogram(
            "parkade:gateway_inter_token_latency_seconds",
            "between successive token events of a request, per token",
            SHORT_BUCKETS,
        )
        self.e2e = self.histogram(
            "parkade:gateway_e2e_request_latency_seconds",
            "from the request's arrival to its last token",
            LATENCY_BUCKETS,
        )
