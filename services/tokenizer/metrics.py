"""The tokenizer service's metrics (see `services/common/metrics.py`): requests tokenized, and
the consumer lag every service reports."""

from __future__ import annotations

from prometheus_client import Counter

from parkade.services.common.metrics import ServiceMetrics


class TokenizerMetrics(ServiceMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.requests = Counter(
            "parkade:tokenizer_requests", "generate requests tokenized", registry=self.registry
        )
