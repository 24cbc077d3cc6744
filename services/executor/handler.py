"""`ExecutorHandler`: the executor service's logic, without I/O.

    step-plans topic  StepPlan -> StepResult (step-results topic)
    at start and on a timer: ExecutorAnnouncement (step-results topic)

Idempotent under redelivery: a plan runs only if it is addressed to this executor and newer
than the last one it ran of its scheduler (running a plan twice would append its sampled tokens
twice).
"""

from __future__ import annotations

import uuid

import msgspec

from parkade.schemas import ExecutorAnnouncement, StepPlan, topics
from parkade.services.bus.base import Outgoing
from parkade.services.executor.executor import Executor


class ExecutorHandler:
    def __init__(
        self, executor: Executor, *, model: str, max_model_len: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.executor = executor
        self.executor_id = uuid.uuid4().hex
        self.model = model
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.scheduler_id: str | None = None
        self.last_step_id = 0
        self.num_heartbeats = 0

    def announcement(self) -> Outgoing:
        config = self.executor.model_config
        message = ExecutorAnnouncement(
            executor_id=self.executor_id,
            model=self.model,
            num_blocks=self.executor.num_blocks,
            block_size=self.executor.block_size,
            max_model_len=self.max_model_len,
            vocab_size=config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            heartbeat=self.num_heartbeats,
        )
        self.num_heartbeats += 1
        return Outgoing(topics.STEP_RESULTS, message)

    def on_plan(self, plan: StepPlan) -> list[Outgoing]:
        """Run one plan (blocking: call it off the event loop)."""
        if plan.executor_id != self.executor_id:
            return []  # for a replaced executor
        if plan.scheduler_id != self.scheduler_id:
            # A new scheduler: its step ids start again, and it knows none of the old requests.
            self.executor.reset()
            self.scheduler_id, self.last_step_id = plan.scheduler_id, 0
        if plan.step_id <= self.last_step_id:
            return []  # redelivered
        result = self.executor.execute(plan)
        self.last_step_id = plan.step_id
        result = msgspec.structs.replace(result, executor_id=self.executor_id)
        return [Outgoing(topics.STEP_RESULTS, result)]
