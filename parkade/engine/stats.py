"""`StatLogger`: the engine's periodic stats line, as vLLM's `LoggingStatLogger` (on when
`disable_log_stats=False`).

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s, Running: 8 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 40.0%

`Engine.step` feeds it each step's events; every LOG_INTERVAL_S it writes one line and starts a
new interval. Throughputs are over that interval: prompt tokens to compute (the scheduler's count
of the tokens it admitted less those the prefix cache served, so a request resumed after a
preemption counts what it computes again) and output tokens sampled. Running, waiting and KV
usage are the scheduler's now; the prefix cache hit rate is since the start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from parkade.schemas import GeneratedTokens
from parkade.services.scheduler.scheduler import Scheduler, SchedulerStats

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0  # vLLM's default (VLLM_LOG_STATS_INTERVAL)


def _make_visible() -> None:
    """NOTE: a user who turned the stats on must see them, also in a script that configured no
    logging (where Python shows warnings only): then this logger gets its own handler at INFO.
    An application's logging configuration, when there is one, is left alone."""
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        log.addHandler(handler)


class StatLogger:
    """Counts one interval's tokens and logs a line when it is over.

    `scheduler` is read, never changed: its `stats()` (a fake in tests). `clock` is
    `time.monotonic` unless given."""

    def __init__(
        self,
        scheduler: Scheduler,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.interval_s = LOG_INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.start = clock()
        self.generation_tokens = 0
        self.computed_at_start = _prompt_tokens_computed(scheduler.stats())
        _make_visible()

    def record(self, events: Sequence[GeneratedTokens]) -> None:
        """Count one step's sampled tokens; log a line if the interval is over."""
        self.generation_tokens += sum(len(event.token_ids) for event in events)
        now = self.clock()
        if now - self.start >= self.interval_s:
            stats = self.scheduler.stats()
            log.info(self.line(now - self.start, stats))
            self.start, self.generation_tokens = now, 0
            self.computed_at_start = _prompt_tokens_computed(stats)

    def line(self, seconds: float, s: SchedulerStats) -> str:
        """The stats line of an interval `seconds` long that ends with the scheduler's stats `s`."""
        seconds = max(seconds, 1e-9)
        prompt_tokens = _prompt_tokens_computed(s) - self.computed_at_start
        return (
            f"Avg prompt throughput: {prompt_tokens / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {100 * s.prefix_cache_hit_rate:.1f}%"
        )


def _prompt_tokens_computed(stats: SchedulerStats) -> int:
    """Prompt tokens admitted and not found in the prefix cache, since the scheduler began."""
    return stats.num_prefix_queries - stats.num_prefix_hits
