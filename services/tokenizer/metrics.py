"""The tokenizer service's metrics (see `services/common/metrics.py`): requests tokenized, where
they were routed, every replica as the router sees it, and the consumer lag every service
reports.

    parkade:routed_requests{replica}          samples sent to each replica
    parkade:routed_predicted_hit_blocks       prompt blocks the router expected cached there
    parkade:handovers                         samples moved off a replica that was gone
    parkade:replica_*{replica}                each replica's last status: up, serving, requests
                                              running and waiting, KV pool use, prefix hit rate;
                                              blocks indexed, predicted and real hit blocks,
                                              KV-event bytes and lag
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from parkade.services.common.metrics import ServiceMetrics
from parkade.services.tokenizer.router import Router


class TokenizerMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.requests = Counter(
            "parkade:tokenizer_requests", "generate requests tokenized", registry=self.registry
        )
        self.routed_requests = Counter(
            "parkade:routed_requests", "samples sent to each replica", ["replica"], registry=self.registry
        )
        self.predicted_hit_blocks = Counter(
            "parkade:routed_predicted_hit_blocks",
            "prompt blocks the router expected cached where it sent them",
            registry=self.registry,
        )
        self.handovers = Counter(
            "parkade:handovers", "samples moved off a replica that was gone", registry=self.registry
        )

    def routed(self, replica: str, predicted_blocks: int) -> None:
        self.routed_requests.labels(replica).inc()
        self.predicted_hit_blocks.inc(predicted_blocks)

    def watch_router(self, router: Router) -> None:
        self.register(_Replicas(router))


class _Replicas(Collector):
    """Read from the metrics server's thread: each replica's state object once (a gauge may be
    a status off, never an error)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"parkade:replica_{name}", doc, labels=["replica"])

        families = {
            "up": gauge("up", "1 while the replica is heard from and not draining"),
            "serving": gauge("serving", "1 while an executor serves the replica"),
            "running": gauge("requests_running", "requests running, as its last status said"),
            "waiting": gauge("requests_waiting", "requests waiting, as its last status said"),
            "usage": gauge("kv_cache_usage", "used blocks / all blocks of its pool, 0 to 1"),
            "hit_rate": gauge("prefix_hit_rate", "prompt tokens found in its prefix cache, 0 to 1"),
            "blocks": gauge("indexed_blocks", "its cached blocks the router knows of"),
            "streams": gauge("open_streams", "samples routed there and still open"),
            "lag": gauge("kv_event_lag_seconds", "age of its last KV event when read"),
        }
        counters = {
            "predicted": CounterMetricFamily(
                "parkade:replica_predicted_hit_blocks", "blocks predicted cached there", labels=["replica"]
            ),
            "real": CounterMetricFamily(
                "parkade:replica_real_hit_blocks", "blocks its scheduler found cached", labels=["replica"]
            ),
            "bytes": CounterMetricFamily(
                "parkade:replica_kv_event_bytes", "KV-event payload read from it", labels=["replica"]
            ),
        }
        for name, state in list(self.router.replicas.items()):
            status = state.status
            labels = [name]
            families["up"].add_metric(labels, 1.0 if self.router.alive(state) else 0.0)
            families["serving"].add_metric(labels, 1.0 if status and status.serving else 0.0)
            families["running"].add_metric(labels, status.num_running if status else 0)
            families["waiting"].add_metric(labels, status.num_waiting if status else 0)
            used = (
                (status.num_blocks - status.num_free_blocks) / status.num_blocks
                if status and status.num_blocks
                else 0.0
            )
            families["usage"].add_metric(labels, used)
            hits = status.prefix_hits / status.prefix_queries if status and status.prefix_queries else 0.0
            families["hit_rate"].add_metric(labels, hits)
            families["blocks"].add_metric(labels, len(state.blocks))
            families["streams"].add_metric(labels, state.streams)
            families["lag"].add_metric(labels, state.kv_event_lag_s)
            counters["predicted"].add_metric(labels, state.predicted_hit_blocks)
            counters["real"].add_metric(labels, state.real_hit_blocks)
            counters["bytes"].add_metric(labels, state.kv_event_bytes)
        yield from families.values()
        yield from counters.values()
