"""Prometheus metrics of a service (prometheus-client), under the `parkade:` prefix, with the
names an operator of vLLM looks for (`vllm:num_requests_running` is
`parkade:num_requests_running` here). Each service's handler owns one registry; the service's
main.py serves it over HTTP (`--metrics-port`), and nothing is measured without it.

What every consuming service exports: `parkade:consumer_lag{topic}`, the records of each topic
it has not read yet, from the broker's high watermark as last fetched (computed at scrape time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds, from a warm prefix's milliseconds to minutes in a deep queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Seconds, for what takes a step or less: step times, gaps between tokens.
SHORT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

# NOTE: no `*_created` series (one per counter and histogram, a timestamp as a sample): vLLM
# turns them off too, and they double what a scrape shows. Process-wide, before any metric exists.
disable_created_metrics()


class ServiceMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lag = _ConsumerLag()
        self.registry.register(self._lag)

    def watch_consumer(self, highwaters: Callable[[], dict[str, int]], positions: dict[str, int]) -> None:
        """Report lag as `highwaters()` minus `positions` (the offset after the last record read,
        by topic; the caller keeps it current)."""
        self._lag.sources.append((highwaters, positions))

    def histogram(
        self, name: str, documentation: str, buckets: tuple[float, ...], **kwargs: Any
    ) -> Histogram:
        return Histogram(name, documentation, buckets=buckets, registry=self.registry, **kwargs)

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _ConsumerLag(Collector):
    def __init__(self) -> None:
        self.sources: list[tuple[Callable[[], dict[str, int]], dict[str, int]]] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("parkade:consumer_lag", "records not read yet, by topic", labels=["topic"])
        for highwaters, positions in self.sources:
            try:
                ends = highwaters()
            except Exception:  # a consumer stopping or reassigned under this (HTTP) thread
                continue
            for topic, end in ends.items():
                if topic in positions:  # not before the first record: its start is unknown here
                    family.add_metric([topic], max(end - positions[topic], 0))
        if family.samples:  # (a family without a sample: a HELP line and nothing under it)
            yield family
