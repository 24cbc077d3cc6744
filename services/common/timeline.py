"""`StepTimeline`: when each step passed each point of its round trip, for benchmarks.

    scheduler  planned ──────────────────────────────────> result_read ─> applied ─> planned (N + k)
    executor             received ─> [compute] ─> computed

A service records its own points on one clock that every process of a host shares
(CLOCK_MONOTONIC); `loadtest/pipeline_bench.py` joins the services' files by step id. Off unless
$PARKADE_STEP_TIMELINE names a folder (read by `run_service`), where each service writes
`<name>.json` when it stops. Bounded: the first `MAX_STEPS` steps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

MAX_STEPS = 200_000


class StepTimeline:
    def __init__(self) -> None:
        self.points: dict[str, dict[int, float]] = {}

    def mark(self, point: str, step_id: int) -> None:
        times = self.points.setdefault(point, {})
        if len(times) < MAX_STEPS:
            times[step_id] = time.monotonic()

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(self.points))
