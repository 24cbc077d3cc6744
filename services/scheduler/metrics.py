"""The scheduler service's metrics (see `services/common/metrics.py`): its queue, the KV pool,
the prefix cache, and each request's latencies as the scheduler sees them (wall clock, from the
request's `arrival_time` at the front end).

    parkade:num_requests_running, parkade:num_requests_waiting     gauges
    parkade:kv_cache_usage_perc                                    used blocks / all blocks
    parkade:prefix_cache_queries_total, ..._hits_total             prompt tokens looked up / found
    parkade:num_preemptions_total, parkade:prompt_tokens_total, parkade:generation_tokens_total
    parkade:iteration_tokens_total                                 histogram: tokens per step
    parkade:time_to_first_token_seconds, parkade:inter_token_latency_seconds,
    parkade:e2e_request_latency_seconds, parkade:request_queue_time_seconds,
    parkade:step_round_trip_seconds                                histograms (a plan sent to its result)

The gauges are read from the scheduler when scraped; the counters and histograms follow the plans
and events the service sends. Per-request timestamps live on the request's `LiveRequest`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from parkade.schemas import EngineRequest, GeneratedTokens, StepPlan
from parkade.services.common.metrics import LATENCY_BUCKETS, SHORT_BUCKETS, ServiceMetrics
from parkade.services.scheduler.live import LiveRequest

_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Gauges:
    """The scheduler's state at scrape time."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used blocks / all blocks (0 to 1)


class SchedulerMetrics(ServiceMetrics):
    """`gauges()` is read at scrape time; the counters count what the plans and events say, so
    they never go back when the scheduler or its pool is replaced (a new executor's)."""

    def __init__(self, gauges: Callable[[], Gauges]) -> None:
        super().__init__()
        self.register(_SchedulerState(self, gauges))
        self.ttft = self.histogram(
            "parkade:time_to_first_token_seconds", "arrival to first token", LATENCY_BUCKETS
        )
        self.itl = self.histogram("parkade:inter_token_latency_seconds", "between tokens", SHORT_BUCKETS)
        self.e2e = self.histogram("parkade:e2e_request_latency_seconds", "arrival to finish", LATENCY_BUCKETS)
        self.queue_time = self.histogram(
            "parkade:request_queue_time_seconds", "arrival to first admission", LATENCY_BUCKETS
        )
        self.iteration_tokens = self.histogram(
            "parkade:iteration_tokens_total", "tokens per step", _TOKEN_BUCKETS
        )
        self.step_round_trip = self.histogram(
            "parkade:step_round_trip_seconds", "a step plan sent to its result", SHORT_BUCKETS
        )
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_prefix_queries = 0  # prompt tokens looked up at admissions
        self.num_prefix_hits = 0  # of them, found in the prefix cache
        self.num_preemptions = 0

    def arrived(self, record: LiveRequest, request: EngineRequest) -> None:
        """The core took the request."""
        self.num_prompt_tokens += len(request.prompt_token_ids)
        record.arrival_time = record.started = request.arrival_time or time.time()

    def planned(self, plan: StepPlan, live: Mapping[str, LiveRequest]) -> None:
        """NOTE: every admission sends its request in full, with its prefix-cache hit, and every
        preemption of a request the executor holds is named: what the core counts, counted here
        from the messages."""
        now = time.time()
        self.iteration_tokens.observe(plan.total_num_scheduled_tokens)
        self.num_preemptions += len(plan.preempted_request_ids)
        for new in plan.new_requests:
            self.num_prefix_queries += len(new.token_ids)
            self.num_prefix_hits += new.num_computed_tokens
            record = live.get(new.request_id)
            if record is not None and record.arrival_time is not None:
                self.queue_time.observe(max(now - record.arrival_time, 0.0))
                record.arrival_time = None

    def generated(self, record: LiveRequest, event: GeneratedTokens) -> None:
        if event.token_ids:
            now = time.time()
            self.num_generation_tokens += len(event.token_ids)
            last = record.last_token_time
            if last is None:
                if record.started is not None:
                    self.ttft.observe(max(now - record.started, 0.0))
            else:
                gap = (now - last) / len(event.token_ids)
                for _ in event.token_ids:
                    self.itl.observe(gap)
            record.last_token_time = now
        if event.finish_reason is not None and record.started is not None and event.error is None:
            self.e2e.observe(max(time.time() - record.started, 0.0))


class _SchedulerState(Collector):
    """The gauges, and the counters, at scrape time."""

    def __init__(self, metrics: SchedulerMetrics, gauges: Callable[[], Gauges]) -> None:
        self.metrics = metrics
        self.gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        gauges, metrics = self.gauges(), self.metrics
        yield GaugeMetricFamily("parkade:num_requests_running", "requests running", value=gauges.num_running)
        yield GaugeMetricFamily("parkade:num_requests_waiting", "requests waiting", value=gauges.num_waiting)
        yield GaugeMetricFamily(
            "parkade:kv_cache_usage_perc", "KV blocks in use (0 to 1)", value=gauges.kv_cache_usage
        )
        counters = {
            "parkade:prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                metrics.num_prefix_queries,
            ),
            "parkade:prefix_cache_hits": ("prompt tokens found in the prefix cache", metrics.num_prefix_hits),
            "parkade:num_preemptions": ("preemptions", metrics.num_preemptions),
            "parkade:prompt_tokens": ("prompt tokens", metrics.num_prompt_tokens),
            "parkade:generation_tokens": ("generated tokens", metrics.num_generation_tokens),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(name, documentation, value=value)
