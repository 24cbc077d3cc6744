"""`EngineCore`: the scheduler and the executor in one process, one step at a time.

    schedule() -> StepPlan -> execute() -> StepResult -> update() -> [GeneratedTokens]

The messages are the ones that cross Kafka between the scheduler and executor services; only
the transport differs.
"""

from __future__ import annotations

from collections.abc import Callable

from parkade.schemas import EngineRequest, FinishReason, GeneratedTokens, StepPlan
from parkade.services.executor.executor import Executor
from parkade.services.executor.simulated import SimulatedExecutor
from parkade.services.scheduler.scheduler import Scheduler


class EngineDeadError(RuntimeError):
    """A step failed, so scheduler and executor may disagree: the engine takes no more work."""


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor | SimulatedExecutor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.dead: BaseException | None = None
        # Called with each plan after scheduling (metrics, benchmarks); never changes behaviour.
        self.on_schedule: Callable[[StepPlan], None] | None = None

    def add_request(self, request: EngineRequest) -> None:
        self._check_alive()
        self.scheduler.add(request)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine failed earlier: {self.dead!r}") from self.dead

    def finish_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT, stop_reason: str | None = None
    ) -> GeneratedTokens | None:
        return self.scheduler.finish_request(request_id, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[GeneratedTokens]:
        self._check_alive()
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
        try:
            result = self.executor.execute(plan)
        except BaseException as error:
            # The scheduler already counted the plan as computed; nothing can be trusted now.
            self.dead = error
            raise EngineDeadError(f"step {plan.step_id} failed: {error!r}") from error
        return self.scheduler.update(plan, result)
