"""`SchedulerHandler`: the scheduler service, without I/O. A relay between its topics, the pure
core (`Scheduler`), the executor link (`ExecutorLink`), one record per live request
(`LiveRequest`, in `LiveRequests`) and the step failures' policy (`StepFailures`).

    tokenized topic     EngineRequest / FinishRequest  -> add / finish (GeneratedTokens on finish)
    step-results topic  ExecutorAnnouncement           -> size the page table; a new executor id
                                                          means recompute everything
                        StepResult                     -> one GeneratedBatch (generated topic)
    after every poll    up to `max_in_flight` StepPlans (step-plans topic); when due, the
                        replica's status and KV events (kv-events topic: `ReplicaPublisher`)

One scheduler per engine replica (`replica`): its tokenized and step topics are the replica's
own (`topics.replica_topic`), its events on the shared generated topic name it.

The configuration is `SchedulerConfig.build(options, the announced geometry)`, as in one
process; options that cannot work on the announced pool answer every request with why.

Failures are answered, never waited on forever. A step the executor could not run comes back
with an error: the executor dropped its request state, so every request is recomputed under the
next epoch (`Scheduler.recompute_all`); a request in too many failed steps in a row ends with an
error event naming the cause, and after its first it runs alone (`StepFailures`). A lost
executor or unanswered steps (`ExecutorLink.check`) void the steps in flight the same way; a
request that waited `executor_wait_s` without an executor ends with an error event.

A restart loses nothing (docs/design.md, "What is durable where"): the commit on the tokenized
topic never passes the oldest live request's record (`low_watermarks`), and the saved progress
on the generated topic stays below every live request's first event (`progress`). A restarted
scheduler reads its own events back from there (`recover`), and resumes each live request read
again with the tokens it generated (recomputed from prompt + outputs, as after a preemption).

NOTE: more than one step is in flight so that Kafka's latency overlaps the executor's compute:
the executor keeps the tokens it samples, so the next decode can be planned before the previous
result has travelled back (the scheduler counts them as output placeholders).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from parkade.schemas import (
    EngineRequest,
    ErrorKind,
    ExecutorAnnouncement,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    SchedulerAnnouncement,
    StepPlan,
    StepResult,
    failed_step,
    topics,
)
from parkade.schemas.routing import DEFAULT_REPLICA
from parkade.services.bus.base import Headers, Outgoing, Record
from parkade.services.bus.serve import Service, rejected_letter
from parkade.services.common import logs
from parkade.services.scheduler import spans
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions
from parkade.services.scheduler.executor_link import (
    DEFAULT_EXECUTOR_TIMEOUT_S,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_STEP_TIMEOUT_S,
    ExecutorLink,
    Heard,
    Lapse,
)
from parkade.services.scheduler.failures import StepFailures
from parkade.services.scheduler.live import LiveRequest, LiveRequests
from parkade.services.scheduler.metrics import Gauges, SchedulerMetrics
from parkade.services.scheduler.replica import ReplicaPublisher
from parkade.services.scheduler.scheduler import OverloadedError, Scheduler

log = logging.getLogger(__name__)

# How long a request may wait while no executor is there to run it.
DEFAULT_EXECUTOR_WAIT_S = 60.0
# How often the waiting requests' deadlines are looked at while there is no executor.
_WAIT_CHECK_S = 0.5


class SchedulerHandler(Service):
    group_id = "parkade-scheduler"
    consumes = (topics.TOKENIZED, topics.STEP_RESULTS)
    poll_ms = 10

    def __init__(
        self,
        options: SchedulingOptions,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        executor_timeout_s: float = DEFAULT_EXECUTOR_TIMEOUT_S,
        executor_wait_s: float = DEFAULT_EXECUTOR_WAIT_S,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        replica: str = DEFAULT_REPLICA,
    ) -> None:
        if executor_wait_s <= 0:
            raise ValueError("executor_wait_s must be > 0")
        self.options = options
        self.executor_wait_s = executor_wait_s
        self.clock = clock
        self.scheduler_id = uuid.uuid4().hex
        # The engine replica it schedules for (schemas/routing.py): its own tokenized and step
        # topics, group and instance claim; its events name it on the shared generated topic.
        self.replica = replica
        self.consumes = (
            topics.replica_topic(topics.TOKENIZED, replica),
            topics.replica_topic(topics.STEP_RESULTS, replica),
        )
        self.plans_topic = topics.replica_topic(topics.STEP_PLANS, replica)
        if replica != DEFAULT_REPLICA:
            self.group_id = f"{SchedulerHandler.group_id}.replica-{replica}"
            self.instance_name = f"scheduler.replica-{replica}"
        self.publisher = ReplicaPublisher(replica, self.scheduler_id, clock=clock)
        # The name its events carry: "" for replica 0, as before replicas (readers take "" as 0).
        self.stamp = "" if replica == DEFAULT_REPLICA else replica
        self.link = ExecutorLink(
            self.scheduler_id,
            max_in_flight=max_in_flight,
            executor_timeout_s=executor_timeout_s,
            step_timeout_s=step_timeout_s,
            clock=clock,
        )
        self.scheduler: Scheduler | None = None  # built on the first executor's geometry
        # Why the options cannot work with the current executor's KV geometry (None: they can).
        self.config_error: str | None = None
        self.live = LiveRequests()  # one record per live request, and the restart's bounds
        self.metrics: SchedulerMetrics | None = None  # see enable_metrics
        self.failures = StepFailures(self.live)  # who is suspected of failing steps
        self._next_wait_check = 0.0
        # Whether the state changed (a record, a plan, a send error) since the last integrity
        # check: the check scans every block of the pool (tens of thousands), so it runs once per
        # idle spell, not after every empty poll (it took half a core on an idle server).
        self._unchecked = True

    def enable_metrics(self) -> SchedulerMetrics:
        """Measure from now on (the service serves them with --metrics-port)."""
        self.metrics = SchedulerMetrics(self.gauges)
        return self.metrics

    def gauges(self) -> Gauges:
        """Read from the metrics server's thread: the scheduler once, the pending count by its
        length, no iteration over a dict the event loop changes (`stats()` sums over the running
        list: at worst a gauge a step off, never an error)."""
        scheduler = self.scheduler
        stats = scheduler.stats() if scheduler is not None else None
        return Gauges(
            num_running=stats.num_running if stats else 0,
            num_waiting=(stats.num_waiting if stats else 0) + len(self.live.pending),
            kv_cache_usage=stats.kv_cache_usage if stats else 0.0,
        )

    def own_topics(self) -> tuple[str, ...]:
        """Its replica's step topics (replica 0's are every deployment's)."""
        return tuple(t for t in (*self.consumes, self.plans_topic) if t not in topics.ALL_TOPICS)

    # ---- restarts ------------------------------------------------------------------------
    def announcement(self) -> Outgoing:
        """Sent once at start: the end of what `recover` reads, and for the tokenizer the news
        that its streams go on (this scheduler resumes its predecessor's requests)."""
        announcement = SchedulerAnnouncement(scheduler_id=self.scheduler_id, resumes=True, replica=self.stamp)
        return Outgoing(topics.GENERATED, announcement)

    def recover(self, start: int, messages: Iterable[object]) -> None:
        """Rebuild from the generated topic's records from offset `start` up to this scheduler's
        announcement: which requests finished, and what each live one generated so far."""
        num_live = self.live.recover(start, messages, self.replica)
        # A clean start recovers nothing: not worth a line at the default level.
        log.log(
            logging.INFO if num_live else logging.DEBUG,
            "recovered %d live requests (generated topic from offset %d)",
            num_live,
            start,
        )

    def on_sent(self, out: Outgoing, offset: int) -> None:
        if out.topic == topics.GENERATED:
            self.live.acknowledged(offset)

    def low_watermarks(self) -> dict[str, int]:
        low = self.live.low_watermark()
        return {self.consumes[0]: low} if low is not None else {}

    def progress(self) -> dict[str, int]:
        return {topics.GENERATED: self.live.progress()}

    # ---- records in ----------------------------------------------------------------------
    def on_record(
        self, message: EngineRequest | FinishRequest | StepResult | ExecutorAnnouncement, record: Record
    ) -> list[Outgoing]:
        self._unchecked = True
        if isinstance(message, StepResult | ExecutorAnnouncement):
            return self.on_step_results(message)
        return self.on_tokenized(message, record.headers, record.offset)

    def on_tokenized(
        self, message: EngineRequest | FinishRequest, headers: Headers = (), offset: int | None = None
    ) -> list[Outgoing]:
        """`offset`: the record's, on the tokenized topic (None: not from the log)."""
        if isinstance(message, FinishRequest):
            return self._on_finish(message)
        request_id = message.request_id
        record = self.live.get(request_id)
        if record is None and request_id in self.live.finished:
            original = self.live.finished.get(request_id)  # its record's offset, where known
            if offset is None or original is None or original == offset:
                return []  # a redelivered request that already ran
            # Another record with the id of a request that ended: a client reusing an id that a
            # restarted tokenizer no longer knows. (A tokenizer's copy of a request that ended
            # here is answered too: after its final event, so the tokenizer drops the answer.)
            error = f"request id {request_id!r} was used by a request that ended recently; use a fresh id"
            return [self._refusal(request_id, error, ErrorKind.INVALID_REQUEST, headers)]
        if record is None:
            record = self.live.open(request_id)
        elif record.request is not None:
            return []  # a redelivered request
        record.request, record.headers, record.source = message, headers, offset
        record.resume(message.output_token_ids)
        spans.arrived(record, len(message.prompt_token_ids))
        if self.link.serving:
            return self._admit(record)
        # A request recovered from the log was admitted before the restart: never refused.
        num_pending = len(self.live.pending)
        if num_pending >= self.options.max_waiting_requests and record.outputs is None:
            error = f"overloaded: {num_pending} requests wait for an executor"
            return self._end_with_error(record, error, ErrorKind.OVERLOADED)
        self.live.wait(record)
        record.waiting_since = self.clock()
        return []

    def _on_finish(self, message: FinishRequest) -> list[Outgoing]:
        """Abort, or a stop string matched: idempotent."""
        record = self.live.get(message.request_id)
        if record is None or record.request is None:
            return []
        if record.request_id in self.live.pending:  # never reached the core
            return [
                self._final_event(
                    record.request_id,
                    record.headers,
                    record.num_outputs_before,
                    message.reason,
                    stop_reason=message.stop_reason,
                )
            ]
        assert self.scheduler is not None
        event = self.scheduler.finish_request(message.request_id, message.reason, message.stop_reason)
        return [self._generated(event)] if event is not None else []

    def _admit(self, record: LiveRequest) -> list[Outgoing]:
        """Hand a read request to the core (an executor serves)."""
        request = record.request
        assert request is not None
        if self.scheduler is None:
            return self._end_with_error(record, self.config_error or "no scheduler", ErrorKind.UNAVAILABLE)
        if max(request.prompt_token_ids) >= self.link.vocab_size:
            # The front end checks this; a record from elsewhere would fail the executor's step.
            error = f"prompt_token_ids must be < {self.link.vocab_size} (the model's vocab_size)"
            return self._end_with_error(record, error, ErrorKind.INVALID_REQUEST)
        try:
            self.scheduler.add(request, record.outputs or ())
        except OverloadedError as error:
            return self._end_with_error(record, str(error), ErrorKind.OVERLOADED)
        except ValueError as error:
            return self._end_with_error(record, str(error), ErrorKind.INVALID_REQUEST)
        record.outputs, record.waiting_since = None, None
        self.live.admitted(record)
        if self.metrics is not None:
            self.metrics.arrived(record, request)
        return []

    # ---- the executor --------------------------------------------------------------------
    def on_step_results(self, message: StepResult | ExecutorAnnouncement) -> list[Outgoing]:
        if isinstance(message, ExecutorAnnouncement):
            return self.on_announcement(message)
        self.link.heard(message.executor_id)
        return self.on_step_result(message)

    def on_announcement(self, announcement: ExecutorAnnouncement) -> list[Outgoing]:
        heard = self.link.on_announcement(announcement)
        if heard is Heard.AHEAD:
            # It failed a step and dropped its state, and the answer did not match a plan in
            # flight (a plan this scheduler did not send): recompute as after a failure.
            self._recompute_everything(epoch=announcement.epoch)
        if heard is not Heard.JOINED:
            return []
        for record in self.live.values():
            record.waiting_since = None
        geometry = KVGeometry(
            announcement.num_blocks, announcement.block_size, announcement.max_model_len,
            announcement.default_batched_tokens,
        )  # fmt: skip
        out: list[Outgoing] = []
        if self.scheduler is not None:
            self._recompute_everything()
            if self.scheduler.config.geometry != geometry:
                # A different pool: block ids and limits of the old one mean nothing there. End
                # the live requests with an error rather than run them on a table that does not fit.
                error = "the executor was replaced by one with another KV pool"
                for request_id in list(self.scheduler.requests):
                    out += self._end_with_error(self.live[request_id], error, ErrorKind.UNAVAILABLE)
                self.scheduler = None
        if self.scheduler is None:
            self._build_scheduler(geometry, announcement.executor_id)
        for record in list(self.live.pending.values()):  # in the order they were read
            out += self._admit(record)
        return out

    def _build_scheduler(self, geometry: KVGeometry, executor_id: str) -> None:
        try:
            self.scheduler = Scheduler(SchedulerConfig.build(self.options, geometry))
            self.link.step_budget = self.scheduler.config.max_num_batched_tokens
            self.config_error = None
            self.publisher.attach(self.scheduler.kv.pool)
        except ValueError as error:
            # Options that cannot work on this executor answer every request with the reason,
            # until an executor they fit announces itself.
            self.config_error = f"the scheduler's options do not fit executor {executor_id}: {error}"

    def on_step_result(self, result: StepResult) -> list[Outgoing]:
        answered = self.link.take(result) if self.scheduler is not None else None
        if answered is None:
            return []  # from a replaced executor, of a void plan, or redelivered
        assert self.scheduler is not None
        if result.error is not None:
            return self._on_failed_step(answered.plan, result)
        if self.timeline is not None:
            self.timeline.mark("result_read", result.step_id)
        self.failures.sampled(result.request_ids)
        events = self.scheduler.update(answered.plan, result)
        if self.metrics is not None:
            self.metrics.step_round_trip.observe(self.clock() - answered.sent_at)
        for event in events:
            self._observe(event)
        if self.timeline is not None:
            self.timeline.mark("applied", result.step_id)
        if not events:
            return []
        return [Outgoing(topics.GENERATED, GeneratedBatch(events=tuple(events), replica=self.stamp))]

    def on_send_error(self, out: Outgoing, error: Exception) -> list[Outgoing]:
        """The broker refused a record this handler produced (too large). A step plan that could
        not be sent is a failed step; a step's batch of events goes again one event a record."""
        self._unchecked = True
        message = out.message
        if isinstance(message, StepPlan):
            if not self.link.in_flight_now(message):
                return []
            failed = failed_step(message, f"the step plan could not be sent: {error}")
            return self._on_failed_step(message, failed)
        if isinstance(message, GeneratedBatch) and len(message.events) > 1:
            # Each event again, alone; its bookkeeping (spans, metrics, records) was done once.
            return [
                Outgoing(
                    topics.GENERATED,
                    msgspec.structs.replace(event, replica=self.stamp),
                    event.request_id,
                    self._headers(event.request_id),
                )
                for event in message.events
            ]
        return [rejected_letter(out, error)]

    def _on_failed_step(self, plan: StepPlan, result: StepResult) -> list[Outgoing]:
        """The executor could not run `plan` and dropped its request state: the plan's requests
        count a failure each (see `StepFailures`), and every request is recomputed."""
        log.warning("the executor failed step %d: %s", plan.step_id, result.error)
        out: list[Outgoing] = []
        for record in self.failures.failed(plan):
            error = f"the executor failed {record.failures} steps with this request: {result.error}"
            out += self._end_with_error(record, error, ErrorKind.INTERNAL)
        self._recompute_everything(epoch=result.epoch + 1)
        return out

    def _recompute_everything(self, epoch: int | None = None) -> None:
        """The executor holds no request state (it failed a step, was lost, or is a new one):
        steps in flight are void, every live request is recomputed under a new epoch."""
        self.link.void(epoch)
        if self.scheduler is not None:
            self.scheduler.recompute_all()

    def next_plans(self) -> list[Outgoing]:
        """The executor's liveness, then step plans until `max_in_flight` are out; when an
        executor serves, nothing is in flight and something changed, the integrity checks."""
        out = self._check_executor()
        if self.scheduler is None:
            return out
        while self.link.has_room:
            plan = self.scheduler.schedule(self.failures.isolated())
            if not (plan.num_scheduled_tokens or plan.finished_request_ids or plan.preempted_request_ids):
                break
            plan = self.link.send(spans.traced(plan, self.live))
            if self.timeline is not None:
                self.timeline.mark("planned", plan.step_id)
            spans.planned(plan, self.live)
            if self.metrics is not None:
                self.metrics.planned(plan, self.live)
            out.append(Outgoing(self.plans_topic, plan))
            self._unchecked = True
        if self.link.serving and not self.link.in_flight and self._unchecked:
            self.check_integrity()
            self._unchecked = False
        return out

    def after_batch(self) -> list[Outgoing]:
        """After every poll (see `Service`): plan, then what the routers are owed."""
        return self.next_plans() + self.replica_records()

    def replica_records(self, force: bool = False) -> list[Outgoing]:
        """The replica's status and KV events, when due (`ReplicaPublisher`)."""
        return self.publisher.records(
            self.scheduler, serving=self.link.serving, num_pending=len(self.live.pending), force=force
        )

    def busy(self) -> bool:
        return bool(self.link.in_flight)  # a step's result is owed

    def check_integrity(self) -> None:
        """The core's invariants, and: every request the core holds has its live record, and
        while an executor serves, none waits for one."""
        assert self.scheduler is not None
        self.scheduler.check_integrity()
        assert self.scheduler.requests.keys() <= self.live.keys()
        assert not self.live.pending or not self.link.serving

    def _check_executor(self) -> list[Outgoing]:
        """The executor's liveness (`ExecutorLink.check`); without an executor, end the requests
        that waited `executor_wait_s` for one."""
        now = self.clock()
        lapse = self.link.check()
        if lapse is not None:
            self._recompute_everything()
        if lapse is Lapse.LOST and self.scheduler is not None:
            for request_id in self.scheduler.requests:
                self.live[request_id].waiting_since = now
        if self.link.serving or now < self._next_wait_check:
            return []
        self._next_wait_check = now + _WAIT_CHECK_S
        out: list[Outgoing] = []
        for record in list(self.live.values()):
            if record.waiting_since is not None and now - record.waiting_since >= self.executor_wait_s:
                error = f"no executor to run this request for {self.executor_wait_s:g} s"
                out += self._end_with_error(record, error, ErrorKind.UNAVAILABLE)
        return out

    # ---- events out ----------------------------------------------------------------------
    def _end_with_error(self, record: LiveRequest, error: str, kind: ErrorKind) -> list[Outgoing]:
        """End a live request, read or not yet in the core, with an error event naming `error`."""
        if self.scheduler is not None and record.request_id in self.scheduler.requests:
            event = self.scheduler.finish_request(
                record.request_id, FinishReason.ERROR, error=error, error_kind=kind
            )
            assert event is not None
            return [self._generated(event)]
        return [self._refusal(record.request_id, error, kind, record.headers, record.num_outputs_before)]

    def _refusal(
        self, request_id: str, error: str, kind: ErrorKind, headers: Headers, index: int = 0
    ) -> Outgoing:
        """The error event of a request the core does not hold (`index`: after what it generated
        before a restart)."""
        extra = {**logs.request(request_id, headers), "reason": str(kind)}
        log.info("request refused (%s): %s", kind, error, extra=extra)
        return self._final_event(request_id, headers, index, FinishReason.ERROR, error=error, error_kind=kind)

    def _final_event(
        self, request_id: str, headers: Headers, index: int, reason: FinishReason, **fields: Any
    ) -> Outgoing:
        """The last event of a request the core does not hold."""
        event = GeneratedTokens(
            request_id=request_id, index=index, token_ids=(), finish_reason=reason, **fields
        )
        return self._generated(event, headers)

    def _generated(self, event: GeneratedTokens, headers: Headers | None = None) -> Outgoing:
        """One event alone on the generated topic, with its request's headers."""
        if headers is None:
            headers = self._headers(event.request_id)
        self._observe(event)
        if event.replica != self.stamp:
            event = msgspec.structs.replace(event, replica=self.stamp)
        return Outgoing(topics.GENERATED, event, event.request_id, headers)

    def _headers(self, request_id: str) -> Headers:
        record = self.live.get(request_id)
        return record.headers if record is not None else ()

    def _observe(self, event: GeneratedTokens) -> None:
        """Every event the handler writes passes here: its request's spans and metrics, and on
        the final one, the end of its record: one removal."""
        record = self.live.get(event.request_id)
        if record is None:
            return
        spans.generated(record, event)
        if self.metrics is not None:
            self.metrics.generated(record, event)
        if event.finish_reason is not None:
            self.live.end(record)
