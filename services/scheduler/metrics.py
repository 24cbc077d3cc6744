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

The gauges and counters are read from the scheduler when scraped: nothing per step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from parkade.schemas import EngineRequest, GeneratedTokens, StepPlan
from parkade.services.common.metrics import LATENCY_BUCKETS, SHORT_BUCKETS, ServiceMetrics

_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerMetrics(ServiceMetrics):
    def __init__(self, handler: Any) -> None:
        super().__init__()
        self.register(_SchedulerState(handler))
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
        # Counts of KV managers and schedulers replaced since (a reset, a new executor's pool):
        # the exported counters never go back.
        self.carried = {"num_prefix_queries": 0, "num_prefix_hits": 0, "num_preemptions": 0}
        self._arrival: dict[str, float] = {}  # request_id -> arrival_time, until admitted
        self._started: dict[str, float] = {}  # request_id -> arrival_time, until finished
        self._last_token: dict[str, float] = {}  # request_id -> when its last token came
        self._sent: dict[int, float] = {}  # step_id -> when its plan went out

    def carry_over(self, scheduler: Any, *, whole: bool) -> None:
        """Before `scheduler`'s KV manager (`whole`: the scheduler itself) is replaced."""
        self.carried["num_prefix_queries"] += scheduler.kv.num_prefix_queries
        self.carried["num_prefix_hits"] += scheduler.kv.num_prefix_hits
        if whole:
            self.carried["num_preemptions"] += scheduler.num_preemptions

    def arrived(self, request: EngineRequest) -> None:
        self.num_prompt_tokens += len(request.prompt_token_ids)
        arrival = request.arrival_time or time.time()
        self._arrival[request.request_id] = arrival
        self._started[request.request_id] = arrival

    def planned(self, plan: StepPlan) -> None:
        now = time.time()
        self._sent[plan.step_id] = time.monotonic()
        self.iteration_tokens.observe(plan.total_num_scheduled_tokens)
        for new in plan.new_requests:
            arrival = self._arrival.pop(new.request_id, None)
            if arrival is not None:
                self.queue_time.observe(max(now - arrival, 0.0))

    def step_done(self, step_id: int) -> None:
        sent = self._sent.pop(step_id, None)
        if sent is not None:
            self.step_round_trip.observe(time.monotonic() - sent)
        if len(self._sent) > 1024:  # plans voided by a failed step or a lost executor
            self._sent.clear()

    def generated(self, event: GeneratedTokens) -> None:
        request_id = event.request_id
        if event.token_ids:
            now = time.time()
            self.num_generation_tokens += len(event.token_ids)
            last = self._last_token.get(request_id)
            if last is None:
                started = self._started.get(request_id)
                if started is not None:
                    self.ttft.observe(max(now - started, 0.0))
            else:
                gap = (now - last) / len(event.token_ids)
                for _ in event.token_ids:
                    self.itl.observe(gap)
            self._last_token[request_id] = now
        if event.finish_reason is not None:
            started = self._started.pop(request_id, None)
            if started is not None and event.error is None:
                self.e2e.observe(max(time.time() - started, 0.0))
            self._arrival.pop(request_id, None)
            self._last_token.pop(request_id, None)


class _SchedulerState(Collector):
    """Gauges and counters read from the handler's scheduler at scrape time."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        handler, scheduler = self.handler, self.handler.scheduler
        metrics = handler.metrics
        running = len(scheduler.running) if scheduler else 0
        waiting = (len(scheduler.waiting) if scheduler else 0) + len(handler.pending)
        yield GaugeMetricFamily("parkade:num_requests_running", "requests running", value=running)
        yield GaugeMetricFamily("parkade:num_requests_waiting", "requests waiting", value=waiting)
        usage = 0.0
        if scheduler is not None and scheduler.kv.num_blocks:
            usage = 1 - scheduler.kv.num_free_blocks / scheduler.kv.num_blocks
        yield GaugeMetricFamily("parkade:kv_cache_usage_perc", "KV blocks in use (0 to 1)", value=usage)
        counters = {
            "parkade:prefix_cache_queries": (
                "prompt tokens looked up in the prefix cache",
                "num_prefix_queries",
            ),
            "parkade:prefix_cache_hits": ("prompt tokens found in the prefix cache", "num_prefix_hits"),
        }
        for name, (documentation, attribute) in counters.items():
            value = metrics.carried[attribute] + (getattr(scheduler.kv, attribute) if scheduler else 0)
            yield CounterMetricFamily(name, documentation, value=value)
        preemptions = metrics.carried["num_preemptions"] + (scheduler.num_preemptions if scheduler else 0)
        yield CounterMetricFamily("parkade:num_preemptions", "preemptions", value=preemptions)
        yield CounterMetricFamily("parkade:prompt_tokens", "prompt tokens", value=metrics.num_prompt_tokens)
        yield CounterMetricFamily(
            "parkade:generation_tokens", "generated tokens", value=metrics.num_generation_tokens
        )
