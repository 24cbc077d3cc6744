"""`ExecutorHandler`: the executor service's logic, without I/O.

    step-plans topic  StepPlan -> StepResult (step-results topic)
    at start and on a timer: ExecutorAnnouncement (step-results topic)

Idempotent under redelivery: a plan runs only if it is addressed to this executor and newer
than the last one it ran of its scheduler (running a plan twice would append its sampled tokens
twice).

A step that raises (out of memory, a bug) is answered, never dropped: a `StepResult` with the
error, after which the executor holds no request state and is at the next epoch. Plans the
scheduler made before it heard of the failure are of the old epoch and are ignored; the scheduler
recomputes every request under the new one.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import msgspec

from parkade.schemas import ExecutorAnnouncement, StepPlan, StepResult, failed_step, topics
from parkade.schemas.routing import DEFAULT_REPLICA
from parkade.services.bus.base import Outgoing, Record
from parkade.services.bus.serve import Service
from parkade.services.common import tracing
from parkade.services.executor.metrics import ExecutorMetrics

if TYPE_CHECKING:  # NOTE: so that `parkade up` reads the executor's flags without torch
    from parkade.services.executor.executor import Executor
    from parkade.services.executor.simulated import SimulatedExecutor

log = logging.getLogger(__name__)


class ExecutorHandler(Service):
    group_id = "parkade-executor"
    consumes = (topics.STEP_PLANS,)
    poll_ms = 10
    send_each = True  # result N goes out before step N+1 runs

    def __init__(
        self, executor: Executor | SimulatedExecutor, *, max_model_len: int, replica: str = DEFAULT_REPLICA
    ) -> None:
        self.executor = executor
        # The replica it serves (see schemas/routing.py): its own step topics and group.
        self.replica = replica
        self.consumes = (topics.replica_topic(topics.STEP_PLANS, replica),)
        self.results_topic = topics.replica_topic(topics.STEP_RESULTS, replica)
        if replica != DEFAULT_REPLICA:
            self.group_id = f"{ExecutorHandler.group_id}.replica-{replica}"
        self.executor_id = uuid.uuid4().hex
        self.max_model_len = max_model_len
        self.scheduler_id: str | None = None
        self.last_step_id = 0
        self.epoch = 0
        self.num_failed_steps = 0
        self.links: dict[str, list] = {}  # per request, while tracing is on: the link to its span
        self.metrics: ExecutorMetrics | None = None  # see enable_metrics
        self.last_step_end: float | None = None
        self.held_requests = False  # whether requests were live when the last step ended

    def enable_metrics(self) -> ExecutorMetrics:
        """Measure from now on (the service serves them with --metrics-port)."""
        self.metrics = ExecutorMetrics()
        return self.metrics

    def announcement(self) -> Outgoing:
        message = ExecutorAnnouncement(
            executor_id=self.executor_id,
            num_blocks=self.executor.num_blocks,
            block_size=self.executor.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.executor.vocab_size,
            scheduler_id=self.scheduler_id or "",
            epoch=self.epoch,
            default_batched_tokens=self.executor.default_batched_tokens,
        )
        return Outgoing(self.results_topic, message)

    def on_record(self, message: StepPlan, record: Record) -> list[Outgoing]:
        return self.on_plan(message)

    def on_plan(self, plan: StepPlan) -> list[Outgoing]:
        """Run one plan (blocking: call it off the event loop)."""
        if plan.executor_id != self.executor_id:
            return []  # for a replaced executor
        if plan.scheduler_id != self.scheduler_id:
            # A new scheduler: its step ids start again, and it knows none of the old requests.
            self._reset()
            self.scheduler_id, self.last_step_id, self.epoch = plan.scheduler_id, 0, plan.epoch
        if plan.epoch < self.epoch:
            return []  # made before the scheduler heard of a failure: void
        if plan.epoch > self.epoch:
            self._reset()  # the scheduler recomputes every request from here
            self.epoch, self.last_step_id = plan.epoch, 0  # step ids are new in a new epoch
        if plan.step_id <= self.last_step_id:
            return []  # redelivered
        self.last_step_id = plan.step_id
        spans = self._start_spans(plan) if tracing.enabled() else []
        if self.timeline is not None:
            self.timeline.mark("received", plan.step_id)
        started = time.perf_counter()
        self._count_idle(started)
        try:
            result = self.executor.execute(plan)
        except Exception as error:
            log.exception("step %d failed; dropping every request's state", plan.step_id)
            for span in spans:
                span.set_status(tracing.trace.Status(tracing.trace.StatusCode.ERROR, str(error)))
                span.end()
            return [Outgoing(self.results_topic, self._failed(plan, error))]
        for span in spans:
            span.end()
        self.last_step_end = ended = time.perf_counter()
        self.held_requests = self.executor.num_requests > 0
        if self.timeline is not None:
            self.timeline.mark("computed", plan.step_id)
        if self.metrics is not None:
            self.metrics.step_time.observe(ended - started)
            self.metrics.busy.inc(ended - started)
            self.metrics.steps.inc()
        result = msgspec.structs.replace(
            result, executor_id=self.executor_id, scheduler_id=plan.scheduler_id, epoch=plan.epoch
        )
        return [Outgoing(self.results_topic, result)]

    def busy(self) -> bool:
        return self.executor.num_requests > 0  # the next plan is owed

    def _count_idle(self, now: float) -> None:
        """The time since the last step ended counts as idle when requests were held then: the
        step the scheduler owed came late (the pipeline's overhead, for its metrics)."""
        if self.metrics is not None and self.last_step_end is not None and self.held_requests:
            self.metrics.idle.inc(now - self.last_step_end)

    def _start_spans(self, plan: StepPlan) -> list:
        """The step's span, linked to the requests it serves, and a prefill span in the trace of
        each request it starts (see services/common/tracing.py)."""
        for request_id in (*plan.finished_request_ids, *plan.preempted_request_ids):
            self.links.pop(request_id, None)
        tracer = tracing.tracer()
        spans = []
        for new in plan.new_requests:
            if new.traceparent:
                # Parsed once per request: each step links to every request it serves.
                self.links[new.request_id] = tracing.link_to(new.traceparent)
                context = tracing.context_of_traceparent(new.traceparent)
                attributes = {"parkade.request_id": new.request_id, "parkade.step_id": plan.step_id}
                spans.append(tracer.start_span("executor.prefill", context=context, attributes=attributes))
        links = [link for r in plan.num_scheduled_tokens for link in self.links.get(r, ())]
        attributes = {
            "parkade.step_id": plan.step_id,
            "parkade.num_tokens": plan.total_num_scheduled_tokens,
            "parkade.num_seqs": len(plan.num_scheduled_tokens),
        }
        spans.append(tracer.start_span("executor.step", links=links, attributes=attributes))
        return spans

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused a step's result (too large): for the scheduler the step failed, and
        the tokens it sampled (which this executor keeps) are dropped with every request's state."""
        result = out.message
        if not isinstance(result, StepResult) or result.error is not None or result.epoch != self.epoch:
            return []  # an announcement (the next heartbeat says it again), or already answered for
        cause = RuntimeError(f"the step's result could not be sent: {error}")
        return [Outgoing(self.results_topic, self._failed(result, cause))]

    def _reset(self) -> None:
        """Drop every request's state; the scheduler sends each live request again as new."""
        self.executor.reset()
        self.links.clear()

    def _failed(self, step: StepPlan | StepResult, error: Exception) -> StepResult:
        """The answer to a step that failed. Its request state may be half updated (a block
        table extended, a token appended), so all of it goes: the next epoch starts empty."""
        self.num_failed_steps += 1
        if self.metrics is not None:
            self.metrics.failed_steps.inc()
        self._reset()
        self.epoch, self.last_step_id = step.epoch + 1, 0
        return failed_step(step, f"{type(error).__name__}: {error}")
