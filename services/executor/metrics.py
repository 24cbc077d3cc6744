"""The executor service's metrics (see `services/common/metrics.py`): the time of each step's
forward pass and sampling, and the tokens it computed."""

from __future__ import annotations

from prometheus_client import Counter

from parkade.services.common.metrics import SHORT_BUCKETS, ServiceMetrics


class ExecutorMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.step_time = self.histogram(
            "parkade:step_time_seconds", "one step: inputs, forward, sampling", SHORT_BUCKETS
        )
        self.steps = Counter("parkade:steps", "steps run", registry=self.registry)
        self.failed_steps = Counter("parkade:failed_steps", "steps that failed", registry=self.registry)
        self.busy = Counter(
            "parkade:executor_busy_seconds", "time spent running steps", registry=self.registry
        )
        self.idle = Counter(
            "parkade:executor_idle_seconds",
            "time between steps while the executor held live requests (waiting for the next plan)",
            registry=self.registry,
        )
