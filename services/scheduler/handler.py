"""`SchedulerHandler`: the scheduler service's logic, without I/O.

    tokenized topic     EngineRequest / FinishRequest  -> add / finish (GeneratedTokens on finish)
    step-results topic  ExecutorAnnouncement           -> size the page table; a new executor id
                                                          means recompute everything
                        StepResult                     -> one GeneratedBatch (generated topic)
    after every poll    up to `max_in_flight` StepPlans (step-plans topic)

The scheduler's configuration is `SchedulerConfig.build(options, the announced geometry)`, as in
one process; options that cannot work on the announced pool (an explicit token budget below its
max_model_len with chunked prefill off) answer every request with an error event naming why.

Failures are answered, never waited on forever. A step the executor could not run comes back
as a `StepResult` with an error: the executor dropped its request state, so every request is
recomputed under the next epoch, and a request in `MAX_STEP_FAILURES` failed steps in a row ends
with an error event naming the cause (after its first, it runs alone). An executor not heard
from for `executor_timeout_s` (it announces itself every few seconds) is declared lost: its
requests wait, and resume on the next executor that announces itself (the same one, if it comes
back); a request that has waited `executor_wait_s` without an executor ends with an error event.
Steps in flight with no answer for `step_timeout_s` from an executor that heartbeats (a record
lost, a forged plan that moved the executor's step count) are void, and so are those of an
epoch the executor's heartbeat says it has left: every request is recomputed.

A restart loses nothing (see the README's "What is durable where"). The group's commit on the
tokenized topic never passes the record of the oldest live request, so a restarted scheduler
reads every live request again; and it keeps, as its progress, an offset of the generated topic
(which it writes) below every live request's first event. At start it sends its announcement,
reads the generated topic from that progress up to the announcement (`recover`): the requests
that finished, and the tokens each live one generated. A live request read again is resumed
with those tokens (recomputed from prompt + outputs, as after a preemption): its next event has
the next index, and its tokens are the ones an uninterrupted run makes (greedy, or seeded, which
draws by output position).

NOTE: more than one step is in flight so that Kafka's latency overlaps the executor's compute:
the executor keeps the tokens it samples, so the next decode can be planned before the previous
result has travelled back (the scheduler counts them as output placeholders).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from parkade.schemas import (
    EngineRequest,
    ErrorKind,
    ExecutorAnnouncement,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    NewRequestData,
    SchedulerAnnouncement,
    StepPlan,
    StepResult,
    topics,
)
from parkade.services.bus.base import Headers, Outgoing
from parkade.services.bus.serve import rejected_letter
from parkade.services.common import logs
from parkade.services.common.recent import RecentIds
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions
from parkade.services.scheduler.metrics import SchedulerMetrics
from parkade.services.scheduler.scheduler import OverloadedError, Scheduler
from parkade.services.scheduler.spans import RequestSpans

log = logging.getLogger(__name__)

# Step plans out at once: the next decode is planned before the previous result is back.
DEFAULT_MAX_IN_FLIGHT = 2
# An executor announces itself every 5 s (its HEARTBEAT_S): three missed beats and it is lost.
DEFAULT_EXECUTOR_TIMEOUT_S = 15.0
# How long a request may wait while no executor is there to run it.
DEFAULT_EXECUTOR_WAIT_S = 60.0
# A step in flight this long without an answer, from an executor that still heartbeats, was lost
# (a plan or result the broker lost, a plan the executor took for a redelivery): every request
# is recomputed under a new epoch. Far above any step's time, and below a client's idle timeout.
DEFAULT_STEP_TIMEOUT_S = 60.0
# A request in this many failed steps in a row ends with the error rather than run again. After
# the first, it runs alone: a request the model cannot run fails alone twice more, while one that
# only shared a step with it (or met a passing fault) succeeds there and starts counting again.
MAX_STEP_FAILURES = 3
# How often the waiting requests' deadlines are looked at while there is no executor.
_WAIT_CHECK_S = 0.5


class SchedulerHandler:
    def __init__(
        self,
        options: SchedulingOptions,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        executor_timeout_s: float = DEFAULT_EXECUTOR_TIMEOUT_S,
        executor_wait_s: float = DEFAULT_EXECUTOR_WAIT_S,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if executor_timeout_s <= 0 or executor_wait_s <= 0 or step_timeout_s <= 0:
            raise ValueError("executor_timeout_s, executor_wait_s and step_timeout_s must be > 0")
        self.options = options
        self.max_in_flight = max_in_flight
        self.executor_timeout_s = executor_timeout_s
        self.executor_wait_s = executor_wait_s
        self.clock = clock
        self.scheduler_id = uuid.uuid4().hex
        self.scheduler: Scheduler | None = None
        # Why the options cannot work with the current executor's KV geometry (None: they can).
        self.config_error: str | None = None
        self.executor_id: str | None = None
        self.vocab_size = 0  # the executor's model's
        self.retired_executors: set[str] = set()  # their late heartbeats must not switch back
        self.finished = RecentIds()  # to drop redelivered requests
        self.pending: dict[str, EngineRequest] = {}  # before an executor has announced itself
        self.in_flight: OrderedDict[int, StepPlan] = OrderedDict()
        self.headers: dict[str, Headers] = {}  # per request: trace context to pass on
        self.spans = RequestSpans()  # per request, while tracing is on
        self.metrics: SchedulerMetrics | None = None  # see enable_metrics
        self.epoch = 0  # of the executor's request state: see StepPlan.epoch
        self.last_heard = 0.0  # when the current executor last announced itself or answered
        self.step_timeout_s = step_timeout_s
        self.last_progress = 0.0  # when a step was last answered, or planned with none in flight
        self.waiting_since: dict[str, float] = {}  # requests waiting for an executor, since when
        self._next_wait_check = 0.0
        self.step_failures: dict[str, int] = {}  # failed steps per live request
        # For a restart (see the module): per live request, the offset of its record on the
        # tokenized topic, and an offset of the generated topic at or below its first event.
        self.sources: dict[str, int] = {}
        self.generated_start: dict[str, int] = {}
        self.generated_end = 0  # the offset after the last generated record acknowledged
        self.resume: dict[str, list[int]] = {}  # read from the log: live requests' outputs
        self.replay_start = 0  # where `recover` read the generated topic from

    def enable_metrics(self) -> SchedulerMetrics:
        """Measure from now on (the service serves them with --metrics-port)."""
        self.metrics = SchedulerMetrics(self)
        return self.metrics

    def announcement(self) -> Outgoing:
        """Sent once at start: the end of what `recover` reads, and for the tokenizer the news
        that its streams go on (this scheduler resumes its predecessor's requests)."""
        return Outgoing(topics.GENERATED, SchedulerAnnouncement(scheduler_id=self.scheduler_id, resumes=True))

    def recover(self, start: int, messages: Iterable[object]) -> None:
        """Rebuild from the generated topic's records from offset `start` up to this scheduler's
        announcement: which requests finished, and what each live one generated so far."""
        self.replay_start = self.generated_end = start
        cut: set[str] = set()  # requests whose first events are below `start`
        for message in messages:
            events = (
                message.events
                if isinstance(message, GeneratedBatch)
                else (message,)
                if isinstance(message, GeneratedTokens)
                else ()
            )
            for event in events:
                if event.finish_reason is not None:
                    self.finished.add(event.request_id)
                    self.resume.pop(event.request_id, None)
                    cut.discard(event.request_id)
                    continue
                outputs = self.resume.setdefault(event.request_id, [])
                if event.index > len(outputs):
                    # A request that was not live at the last progress (it ends further on), or
                    # one whose history is lost (which the progress rule excludes).
                    cut.add(event.request_id)
                    continue
                # Events of one request are in index order; one read twice overlaps.
                outputs.extend(event.token_ids[len(outputs) - event.index :])
        for request_id in cut & self.resume.keys():
            log.error("request %s: its first events are below offset %d; it starts again", request_id, start)
            self.resume[request_id] = []
        log.warning("recovered %d live requests (generated topic from offset %d)", len(self.resume), start)

    def on_sent(self, out: Outgoing, offset: int) -> None:
        """The broker acknowledged a record at `offset` (see the module: a restart's bounds)."""
        if out.topic == topics.GENERATED:
            self.generated_end = max(self.generated_end, offset + 1)

    def low_watermarks(self) -> dict[str, int]:
        """The oldest tokenized record a restart must read again: the oldest live request's."""
        return {topics.TOKENIZED: min(self.sources.values())} if self.sources else {}

    def progress(self) -> dict[str, int]:
        """Where a restart reads the generated topic from: below every live request's events,
        those recovered but not read again yet included."""
        starts = [*self.generated_start.values(), *([self.replay_start] if self.resume else [])]
        return {topics.GENERATED: min(starts, default=self.generated_end)}

    def on_step_results(self, message: StepResult | ExecutorAnnouncement) -> list[Outgoing]:
        if message.executor_id == self.executor_id:
            self.last_heard = self.clock()
        if isinstance(message, ExecutorAnnouncement):
            return self.on_announcement(message)
        return self.on_step_result(message)

    def on_announcement(self, announcement: ExecutorAnnouncement) -> list[Outgoing]:
        if announcement.executor_id == self.executor_id:
            self.last_heard = self.clock()
            if announcement.scheduler_id == self.scheduler_id and announcement.epoch > self.epoch:
                # It failed a step and dropped its state, and the answer did not match a plan
                # in flight (a plan this scheduler did not send): recompute as after a failure.
                log.warning("the executor is at epoch %d, ahead of %d", announcement.epoch, self.epoch)
                self._recompute_everything(epoch=announcement.epoch)
            return []  # a heartbeat
        if announcement.executor_id in self.retired_executors:
            return []  # a late heartbeat of an executor already replaced
        if self.executor_id is not None:
            self.retired_executors.add(self.executor_id)
        # (An executor declared lost is not retired: when it is heard again, it is adopted anew.)
        log.info(
            "executor %s joined: %d blocks of %d tokens (replacing %s)",
            announcement.executor_id, announcement.num_blocks, announcement.block_size, self.executor_id,
            extra={"executor_id": announcement.executor_id},
        )  # fmt: skip
        self.executor_id = announcement.executor_id
        self.vocab_size = announcement.vocab_size
        self.last_heard = self.clock()
        self.waiting_since.clear()
        geometry = KVGeometry(announcement.num_blocks, announcement.block_size, announcement.max_model_len)
        out: list[Outgoing] = []
        if self.scheduler is not None:
            self._recompute_everything()
            if self.scheduler.config.geometry == geometry:
                # Same pool shape: every request is recomputed there.
                for request in self.pending.values():
                    out += self._add(request)
                self.pending.clear()
                return out
            # A different pool: block ids and limits of the old one mean nothing there. End the
            # live requests with an error rather than run them on a page table that does not fit.
            for request_id in list(self.scheduler.requests):
                error = "the executor was replaced by one with another KV pool"
                out.append(self._refused(request_id, error, ErrorKind.UNAVAILABLE))
            if self.metrics is not None:
                self.metrics.carry_over(self.scheduler, whole=True)
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

    def on_tokenized(
        self, message: EngineRequest | FinishRequest, headers: Headers = (), offset: int | None = None
    ) -> list[Outgoing]:
        """`offset`: the record's, on the tokenized topic (None: not from the log)."""
        request_id = message.request_id
        if isinstance(message, FinishRequest):
            if self.pending.pop(request_id, None) is not None:  # never reached the scheduler
                event = GeneratedTokens(
                    request_id=request_id,
                    index=len(self.resume.get(request_id, ())),  # after what it generated before
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
            original = self.finished.get(request_id)  # its record's offset, where known
            if offset is None or original is None or original == offset:
                return []  # a redelivered request that already ran
            # Another record with the id of a request that ended: a client reusing an id that a
            # restarted tokenizer no longer knows. (A tokenizer's copy of a request that ended
            # here is answered too: after its final event, so the tokenizer drops the answer.)
            self.headers[request_id] = headers
            error = f"request id {request_id!r} was used by a request that ended recently; use a fresh id"
            return [self._refused(request_id, error, ErrorKind.INVALID_REQUEST)]
        self.headers.setdefault(request_id, headers)
        self.spans.arrived(request_id, headers, len(message.prompt_token_ids))
        if offset is not None:
            self.sources.setdefault(request_id, offset)
        start = self.replay_start if request_id in self.resume else self.generated_end
        self.generated_start.setdefault(request_id, start)
        if self.executor_id is None:
            if request_id in self.pending:
                return []  # a redelivered request
            # A request recovered from the log was admitted before the restart: never refused.
            if len(self.pending) >= self.options.max_waiting_requests and request_id not in self.resume:
                error = f"overloaded: {len(self.pending)} requests wait for an executor"
                return [self._refused(request_id, error, ErrorKind.OVERLOADED)]
            self.pending[request_id] = message
            self.waiting_since.setdefault(request_id, self.clock())
            return []
        return self._add(message)

    def _add(self, request: EngineRequest) -> list[Outgoing]:
        if self.scheduler is None:
            error = self.config_error or "no scheduler"
            return [self._refused(request.request_id, error, ErrorKind.UNAVAILABLE)]
        if request.request_id in self.scheduler.requests or request.request_id in self.finished:
            return []  # a redelivered request
        if max(request.prompt_token_ids) >= self.vocab_size:
            # The front end checks this; a record from elsewhere would fail the executor's step.
            error = f"prompt_token_ids must be < {self.vocab_size} (the model's vocab_size)"
            return [self._refused(request.request_id, error, ErrorKind.INVALID_REQUEST)]
        try:
            self.scheduler.add(request, self.resume.get(request.request_id, ()))
            if self.metrics is not None:
                self.metrics.arrived(request)
        except OverloadedError as error:
            return [self._refused(request.request_id, str(error), ErrorKind.OVERLOADED)]
        except ValueError as error:
            return [self._refused(request.request_id, str(error), ErrorKind.INVALID_REQUEST)]
        self.resume.pop(request.request_id, None)
        return []

    def _refused(self, request_id: str, error: str, kind: ErrorKind) -> Outgoing:
        log.info(
            "request refused (%s): %s",
            kind,
            error,
            extra={**logs.request(request_id, self.headers.get(request_id, ())), "reason": str(kind)},
        )
        event = GeneratedTokens(
            request_id=request_id,
            index=len(self.resume.get(request_id, ())),  # after what it generated before a restart
            token_ids=(),
            finish_reason=FinishReason.ERROR,
            error=error,
            error_kind=kind,
        )
        return self._generated(event)

    def on_step_result(self, result: StepResult) -> list[Outgoing]:
        if (
            self.scheduler is None
            or result.scheduler_id != self.scheduler_id
            or result.executor_id != self.executor_id
            or result.epoch != self.epoch
            or result.step_id not in self.in_flight
        ):
            return []  # from a replaced executor, of a void plan, or redelivered
        if result.error is not None:
            return self._on_failed_step(self.in_flight[result.step_id], result)
        self.last_progress = self.clock()
        # Results come back in step order (one partition, one executor): older plans are done.
        while True:
            step_id, plan = self.in_flight.popitem(last=False)
            if step_id == result.step_id:
                break
        if self.step_failures:  # suspects that sampled a token batch again, their count cleared
            self.scheduler.clear_suspects(result.request_ids)
            for request_id in result.request_ids:
                self.step_failures.pop(request_id, None)
        events = self.scheduler.update(plan, result)
        if self.metrics is not None:
            self.metrics.step_done(result.step_id)
        for event in events:
            self._forget_if_finished(event)
        return [Outgoing(topics.GENERATED, GeneratedBatch(events=tuple(events)))] if events else []

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused a record this handler produced (too large). A step plan that could
        not be sent is a failed step; a step's batch of events goes again one event a record."""
        message = out.message
        if isinstance(message, StepPlan):
            if message.step_id not in self.in_flight or message.epoch != self.epoch:
                return []
            failed = StepResult(
                step_id=message.step_id,
                executor_id=message.executor_id,
                scheduler_id=message.scheduler_id,
                epoch=message.epoch,
                error=f"the step plan could not be sent: {error}",
            )
            return self._on_failed_step(message, failed)
        if isinstance(message, GeneratedBatch) and len(message.events) > 1:
            # Each event again, alone; its bookkeeping (spans, metrics, tables) was done once.
            return [
                Outgoing(topics.GENERATED, event, event.request_id, self.headers.get(event.request_id, ()))
                for event in message.events
            ]
        return [rejected_letter(out, error)]

    def _on_failed_step(self, plan: StepPlan, result: StepResult) -> list[Outgoing]:
        """The executor could not run `plan` and dropped its request state: the plan's requests
        count one failure each (ended at `MAX_STEP_FAILURES`), and every request is recomputed."""
        assert self.scheduler is not None
        log.warning("the executor failed step %d: %s", plan.step_id, result.error)
        out: list[Outgoing] = []
        suspects = []
        for request_id in plan.num_scheduled_tokens:
            failures = self.step_failures[request_id] = self.step_failures.get(request_id, 0) + 1
            if failures < MAX_STEP_FAILURES:
                suspects.append(request_id)
                continue
            error = f"the executor failed {failures} steps with this request: {result.error}"
            out += self._end_with_error(request_id, error, ErrorKind.INTERNAL)
        # The suspects run alone next, so a failure that repeats is pinned on its request and
        # does not end the others that happened to share its step.
        self._recompute_everything(epoch=result.epoch + 1, suspects=suspects)
        return out

    def _end_with_error(self, request_id: str, error: str, kind: ErrorKind) -> list[Outgoing]:
        """End a live request, pending or in the scheduler, with an error event naming `error`."""
        if self.pending.pop(request_id, None) is not None:
            return [self._refused(request_id, error, kind)]
        if self.scheduler is None:
            return []
        event = self.scheduler.finish_request(request_id, FinishReason.ERROR, error=error, error_kind=kind)
        return [self._generated(event)] if event is not None else []

    def _recompute_everything(self, epoch: int | None = None, suspects: list[str] | None = None) -> None:
        """The executor holds no request state (it failed a step, was lost, or is a new one):
        steps in flight are void, every live request is recomputed under a new epoch."""
        self.in_flight.clear()
        self.epoch = self.epoch + 1 if epoch is None else epoch
        if self.scheduler is not None:
            if self.metrics is not None:
                self.metrics.carry_over(self.scheduler, whole=False)  # a new KV manager follows
            self.scheduler.reset_executor(suspects or ())

    def check_executor(self) -> list[Outgoing]:
        """Declare the executor lost after `executor_timeout_s` of silence; end the requests that
        waited `executor_wait_s` without one. Runs after every poll."""
        now = self.clock()
        if self.in_flight and now - self.last_progress > self.step_timeout_s:
            log.warning(
                "no answer to step %d for %.0f s: the steps in flight are void; recomputing",
                next(iter(self.in_flight)),
                now - self.last_progress,
            )
            self._recompute_everything()
        if self.executor_id is not None and now - self.last_heard > self.executor_timeout_s:
            log.warning(
                "executor %s not heard from for %.0f s: lost; its requests wait for an executor",
                self.executor_id,
                now - self.last_heard,
            )
            self.executor_id = None
            self._recompute_everything()
            for request_id in self.scheduler.requests if self.scheduler else ():
                self.waiting_since.setdefault(request_id, now)
        if self.executor_id is not None or not self.waiting_since or now < self._next_wait_check:
            return []
        self._next_wait_check = now + _WAIT_CHECK_S
        out: list[Outgoing] = []
        for request_id, since in list(self.waiting_since.items()):
            if now - since < self.executor_wait_s:
                continue
            error = f"no executor to run this request for {self.executor_wait_s:g} s"
            out += self._end_with_error(request_id, error, ErrorKind.UNAVAILABLE)
            self.waiting_since.pop(request_id, None)
        return out

    def next_plans(self) -> list[Outgoing]:
        """Plan steps until `max_in_flight` are out; checks the block manager when idle."""
        out = self.check_executor()
        if self.scheduler is None or self.executor_id is None:
            return out
        if not self.in_flight:
            self.last_progress = self.clock()
        while len(self.in_flight) < self.max_in_flight:
            plan = self.scheduler.schedule()
            if not (plan.num_scheduled_tokens or plan.finished_request_ids or plan.preempted_request_ids):
                break
            plan = msgspec.structs.replace(
                plan,
                executor_id=self.executor_id,
                scheduler_id=self.scheduler_id,
                epoch=self.epoch,
                new_requests=self._traced(plan.new_requests),
            )
            self.spans.planned(plan)
            if self.metrics is not None:
                self.metrics.planned(plan)
            self.in_flight[plan.step_id] = plan
            out.append(Outgoing(topics.STEP_PLANS, plan))
        if not self.in_flight:
            self.scheduler.check_integrity()
        return out

    def _traced(self, new_requests: tuple[NewRequestData, ...]) -> tuple[NewRequestData, ...]:
        """The new requests with their trace context, for the executor's spans (tracing on)."""
        if not self.spans.request:
            return new_requests
        return tuple(
            msgspec.structs.replace(new, traceparent=self.spans.traceparent(new.request_id))
            for new in new_requests
        )

    def _generated(self, event: GeneratedTokens) -> Outgoing:
        headers = self.headers.get(event.request_id, ())
        self._forget_if_finished(event)
        return Outgoing(topics.GENERATED, event, event.request_id, headers)

    def _forget_if_finished(self, event: GeneratedTokens) -> None:
        """Every event the handler writes passes here: its span's bookkeeping, and a finished
        request's tables."""
        self.spans.generated(event)
        if self.metrics is not None:
            self.metrics.generated(event)
        if event.finish_reason is not None:
            self.headers.pop(event.request_id, None)
            self.step_failures.pop(event.request_id, None)
            self.waiting_since.pop(event.request_id, None)
            source = self.sources.pop(event.request_id, None)
            self.generated_start.pop(event.request_id, None)
            self.resume.pop(event.request_id, None)
            self.finished.add(event.request_id, source)
