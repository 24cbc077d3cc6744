"""`SchedulerHandler`: the scheduler service's logic, without I/O.

    tokenized topic     EngineRequest / FinishRequest  -> add / finish (GeneratedTokens on finish)
    step-results topic  ExecutorAnnouncement           -> size the page table; a new executor id
                                                          means recompute everything
                        StepResult                     -> one GeneratedBatch (generated topic)
    after every poll    up to `max_in_flight` StepPlans (step-plans topic)

The scheduler's configuration is `SchedulerConfig.build(options, the announced geometry)`, as in
one process; options that cannot work on the announced pool (an explicit token budget below its
max_model_len with chunked prefill off) answer every request with an error event naming why.

NOTE: more than one step is in flight so that Kafka's latency overlaps the executor's compute:
the executor keeps the tokens it samples, so the next decode can be planned before the previous
result has travelled back (the scheduler counts them as output placeholders).
"""

from __future__ import annotations

import uuid
from collections import OrderedDict

import msgspec

from parkade.schemas import (
    EngineRequest,
    ExecutorAnnouncement,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    SchedulerAnnouncement,
    StepPlan,
    StepResult,
    topics,
)
from parkade.services.bus.base import Headers, Outgoing
from parkade.services.common.recent import RecentIds
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions
from parkade.services.scheduler.scheduler import Scheduler

# Step plans out at once: the next decode is planned before the previous result is back.
DEFAULT_MAX_IN_FLIGHT = 2


class SchedulerHandler:
    def __init__(self, options: SchedulingOptions, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.options = options
        self.max_in_flight = max_in_flight
        self.scheduler_id = uuid.uuid4().hex
        self.scheduler: Scheduler | None = None
        # Why the options cannot work with the current executor's KV geometry (None: they can).
        self.config_error: str | None = None
        self.executor_id: str | None = None
        self.retired_executors: set[str] = set()  # their late heartbeats must not switch back
        self.finished = RecentIds()  # to drop redelivered requests
        self.pending: dict[str, EngineRequest] = {}  # before an executor has announced itself
        self.in_flight: OrderedDict[int, StepPlan] = OrderedDict()
        self.headers: dict[str, Headers] = {}  # per request: trace context to pass on

    def announcement(self) -> Outgoing:
        """Sent once at start, so the tokenizer can tell a restart."""
        return Outgoing(topics.GENERATED, SchedulerAnnouncement(scheduler_id=self.scheduler_id))

    def on_step_results(self, message: StepResult | ExecutorAnnouncement) -> list[Outgoing]:
        if isinstance(message, ExecutorAnnouncement):
            return self.on_announcement(message)
        return self.on_step_result(message)

    def on_announcement(self, announcement: ExecutorAnnouncement) -> list[Outgoing]:
        if announcement.executor_id == self.executor_id or announcement.executor_id in self.retired_executors:
            return []  # a heartbeat, or a late one of an executor already replaced
        if self.executor_id is not None:
            self.retired_executors.add(self.executor_id)
        self.executor_id = announcement.executor_id
        geometry = KVGeometry(announcement.num_blocks, announcement.block_size, announcement.max_model_len)
        out: list[Outgoing] = []
        if self.scheduler is not None:
            self.in_flight.clear()
            if self.scheduler.config.geometry == geometry:
                self.scheduler.reset_executor()  # same pool shape: recompute everything there
                return []
            # A different pool: block ids and limits of the old one mean nothing there. End the
            # live requests with an error rather than run them on a page table that does not fit.
            for request_id in list(self.scheduler.requests):
                out.append(self._refused(request_id, "the executor was replaced by one with another KV pool"))
            self.scheduler = None
        try:
            self.scheduler = Scheduler(SchedulerConfig.build(self.options, geometry))
            self.config_error = None
        except ValueError as error:
            # Options that cannot work on this executor answer every request with the reason,
            # until an executor they fit announces itself.
            self.config_error = (
                f"the scheduler's options do not fit executor {announcement.executor_id}: {error}"
            )
        for request in self.pending.values():
            out += self._add(request)
        self.pending.clear()
        return out

    def on_tokenized(self, message: EngineRequest | FinishRequest, headers: Headers = ()) -> list[Outgoing]:
        request_id = message.request_id
        if isinstance(message, FinishRequest):
            if self.pending.pop(request_id, None) is not None:  # never reached the scheduler
                event = GeneratedTokens(
                    request_id=request_id,
                    index=0,
                    token_ids=(),
                    finish_reason=message.reason,
                    stop_reason=message.stop_reason,
                )
                return [self._generated(event)]
            event = (
                self.scheduler.finish_request(request_id, message.reason, message.stop_reason)
                if self.scheduler
                else None
            )
            return [self._generated(event)] if event is not None else []
        if request_id in self.finished:
            return []  # a redelivered request that already ran
        self.headers.setdefault(request_id, headers)
        if self.executor_id is None:
            self.pending.setdefault(request_id, message)
            return []
        return self._add(message)

    def _add(self, request: EngineRequest) -> list[Outgoing]:
        if self.scheduler is None:
            return [self._refused(request.request_id, self.config_error or "no scheduler")]
        if request.request_id in self.scheduler.requests:
            return []  # a redelivered request
        try:
            self.scheduler.add(request)
        except ValueError as error:
            return [self._refused(request.request_id, str(error))]
        return []

    def _refused(self, request_id: str, error: str) -> Outgoing:
        event = GeneratedTokens(
            request_id=request_id, index=0, token_ids=(), finish_reason=FinishReason.ERROR, error=error
        )
        return self._generated(event)

    def on_step_result(self, result: StepResult) -> list[Outgoing]:
        if (
            self.scheduler is None
            or result.executor_id != self.executor_id
            or result.step_id not in self.in_flight
        ):
            return []  # from a replaced executor, or redelivered
        # Results come back in step order (one partition, one executor): older plans are done.
        while True:
            step_id, plan = self.in_flight.popitem(last=False)
            if step_id == result.step_id:
                break
        events = self.scheduler.update(plan, result)
        for event in events:
            self._forget_if_finished(event)
        return [Outgoing(topics.GENERATED, GeneratedBatch(events=tuple(events)))] if events else []

    def next_plans(self) -> list[Outgoing]:
        """Plan steps until `max_in_flight` are out; checks the block manager when idle."""
        out: list[Outgoing] = []
        if self.scheduler is None or self.executor_id is None:
            return out
        while len(self.in_flight) < self.max_in_flight:
            plan = self.scheduler.schedule()
            if not (plan.num_scheduled_tokens or plan.finished_request_ids or plan.preempted_request_ids):
                break
            plan = msgspec.structs.replace(plan, executor_id=self.executor_id, scheduler_id=self.scheduler_id)
            self.in_flight[plan.step_id] = plan
            out.append(Outgoing(topics.STEP_PLANS, plan))
        if not self.in_flight:
            self.scheduler.check_integrity()
        return out

    def _generated(self, event: GeneratedTokens) -> Outgoing:
        headers = self.headers.get(event.request_id, ())
        self._forget_if_finished(event)
        return Outgoing(topics.GENERATED, event, event.request_id, headers)

    def _forget_if_finished(self, event: GeneratedTokens) -> None:
        if event.finish_reason is not None:
            self.headers.pop(event.request_id, None)
            self.finished.add(event.request_id)
