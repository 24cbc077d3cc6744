"""`EngineCore`: the scheduler and the executor in one process, one step at a time.

    schedule() -> StepPlan -> execute() -> StepResult -> update() -> [GeneratedTokens]

The messages are the ones that cross Kafka between the scheduler and executor services; only
the transport differs.
"""

from __future__ import annotations

from collections.abc import Callable

from parkade.schemas import EngineRequest, FinishReason, GeneratedTokens, StepPlan
from parkade.services.executor.executor import Executor
from parkade.services.scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # Called with each plan after scheduling (metrics, benchmarks); never changes behaviour.
        self.on_schedule: Callable[[StepPlan], None] | None = None

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add(request)

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, stop_reason: str | None = None
    ) -> GeneratedTokens | None:
        return self.scheduler.finish_request(request_id, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[GeneratedTokens]:
        plan = self.scheduler.schedule()
        if self.on_schedule is not None:
            self.on_schedule(plan)
        if not plan.num_scheduled_tokens:
            # Nothing is in flight between steps here, so the block manager must add up.
            self.scheduler.check_integrity()
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}")
            if not plan.finished_request_ids:
                return []
        result = self.executor.execute(plan)
        return self.scheduler.update(plan, result)
