"""`ExecutorLink`: the scheduler service's side of its link to the executor that serves it.

    which executor serves (`executor_id`), and the ones it replaced (`retired`)
    the epoch of the executor's request state both sides build on (see `StepPlan.epoch`)
    when the executor was last heard, and when a step was last answered
    the step plans in flight, oldest first, with when each went out

It decides nothing about requests: it tells the handler what happened (a new executor joined,
the executor is ahead of our epoch, it went silent, a step went unanswered), and the handler
recomputes every request when the executor's state is gone (`void` moves the epoch on).

Liveness. An executor announces itself every few seconds; one not heard from for
`executor_timeout_s` is lost (an executor declared lost is not retired: heard again, it is
adopted anew). Steps in flight with no answer for `step_timeout_s` from an executor that still
heartbeats (a record the broker lost, a forged plan that moved the executor's step count) are
void: results come back in step order, so nothing behind them would ever be answered.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from parkade.schemas import ExecutorAnnouncement, StepPlan, StepResult

log = logging.getLogger(__name__)

# Step plans out at once: the next decodes are planned before the previous result is back.
# NOTE: 3, not 2: under load a step's compute stretches (the services share the CPUs) and a
# result's way back through the broker takes a few ms more, so with 2 the executor waited for
# plans (the step timeline: 0.22 s of a 3.3 s round). Measured on `parkade up` under vLLM's
# client (tiny-llama, 64 streams, 2 vCPUs), alternated: 2,380, 2,337 and 2,336 against 1,899,
# 1,845 and 2,327 tok/s, the executor idle 0.31 against 0.44-0.51 s; one stream's mean TPOT 7.2
# against 8.9 ms, four streams' 10.0 against 14.4. The cost: a request that stops on EOS or a stop
# string may have one more token computed and dropped.
DEFAULT_MAX_IN_FLIGHT = 3
# The plans out need not be that deep when they are big: a plan beyond the first FULL_DEPTH goes
# out only while the plans out hold fewer tokens than one step's budget. Small (decode) steps are
# kept 3 deep as above; a queue of full prefill steps only keeps the requests admitted into the
# newest waiting for the ones before it (a burst of 64 prompts of 256 tokens under vLLM's client:
# 60-64 against 86-110 ms from admission to the start of the request's prefill step).
FULL_DEPTH = 2
# An executor announces itself every 5 s (its HEARTBEAT_S): three missed beats and it is lost.
DEFAULT_EXECUTOR_TIMEOUT_S = 15.0
# A step in flight this long without an answer, from an executor that still heartbeats, was lost
# (a plan or result the broker lost, a plan the executor took for a redelivery): every request
# is recomputed under a new epoch. Far above any step's time, and below a client's idle timeout.
DEFAULT_STEP_TIMEOUT_S = 60.0


class Heard(enum.Enum):
    """What an announcement on the step-results topic means for the scheduler."""

    NOTHING = "nothing"  # a heartbeat, or a late one of an executor already replaced
    JOINED = "joined"  # a new executor, adopted: its pool holds no request
    AHEAD = "ahead"  # ours, at a later epoch: it failed a step whose answer matched no plan


class Lapse(enum.Enum):
    """What `check` found."""

    STEP_TIMEOUT = "step_timeout"  # the steps in flight are void
    LOST = "lost"  # the executor is gone (and its steps in flight with it)


@dataclass(slots=True)
class InFlight:
    plan: StepPlan
    sent_at: float  # on the link's clock


class ExecutorLink:
    def __init__(
        self,
        scheduler_id: str,
        *,
        max_in_flight: int,
        executor_timeout_s: float,
        step_timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if executor_timeout_s <= 0 or step_timeout_s <= 0:
            raise ValueError("executor_timeout_s and step_timeout_s must be > 0")
        self.scheduler_id = scheduler_id
        self.max_in_flight = max_in_flight
        self.executor_timeout_s = executor_timeout_s
        self.step_timeout_s = step_timeout_s
        self.clock = clock
        self.executor_id: str | None = None  # None: no executor serves (none yet, or lost)
        self.vocab_size = 0  # the serving executor's model's
        self.retired: set[str] = set()  # replaced: their late heartbeats must not switch back
        self.epoch = 0
        self.last_heard = 0.0
        self.last_progress = 0.0  # a step answered, or the first plan sent with none in flight
        self.in_flight: OrderedDict[int, InFlight] = OrderedDict()
        # One step's token budget (the scheduler's max_num_batched_tokens; None: not known yet).
        self.step_budget: int | None = None

    @property
    def serving(self) -> bool:
        return self.executor_id is not None

    @property
    def tokens_in_flight(self) -> int:
        """Scheduled tokens of the plans in flight (at most `max_in_flight` plans to add up)."""
        return sum(sum(f.plan.num_scheduled_tokens.values()) for f in self.in_flight.values())

    @property
    def has_room(self) -> bool:
        """An executor serves and fewer than `max_in_flight` plans are out; beyond FULL_DEPTH,
        only while those hold less than a step's token budget."""
        out = len(self.in_flight)
        if self.executor_id is None or out >= self.max_in_flight:
            return False
        return out < FULL_DEPTH or self.step_budget is None or self.tokens_in_flight < self.step_budget

    def heard(self, executor_id: str) -> None:
        """A record from `executor_id` (a result or an announcement)."""
        if executor_id == self.executor_id:
            self.last_heard = self.clock()

    def on_announcement(self, announcement: ExecutorAnnouncement) -> Heard:
        self.heard(announcement.executor_id)
        if announcement.executor_id == self.executor_id:
            if announcement.scheduler_id == self.scheduler_id and announcement.epoch > self.epoch:
                log.warning("the executor is at epoch %d, ahead of %d", announcement.epoch, self.epoch)
                return Heard.AHEAD
            return Heard.NOTHING
        if announcement.executor_id in self.retired:
            return Heard.NOTHING
        if self.executor_id is not None:
            self.retired.add(self.executor_id)
        log.info(
            "executor %s joined: %d blocks of %d tokens%s",
            announcement.executor_id, announcement.num_blocks, announcement.block_size,
            f" (replacing {self.executor_id})" if self.executor_id is not None else "",
            extra={"executor_id": announcement.executor_id},
        )  # fmt: skip
        self.executor_id, self.vocab_size = announcement.executor_id, announcement.vocab_size
        self.last_heard = self.clock()
        return Heard.JOINED

    def send(self, plan: StepPlan) -> StepPlan:
        """`plan` addressed to the serving executor under the current epoch, now in flight."""
        assert self.executor_id is not None
        plan = msgspec.structs.replace(
            plan, executor_id=self.executor_id, scheduler_id=self.scheduler_id, epoch=self.epoch
        )
        now = self.clock()
        if not self.in_flight:
            self.last_progress = now  # the step timeout counts from the first plan out
        self.in_flight[plan.step_id] = InFlight(plan, now)
        return plan

    def take(self, result: StepResult) -> InFlight | None:
        """The plan `result` answers, out of flight with every older one (results come back in
        step order: one partition, one executor); None for a result of another executor,
        scheduler or epoch, or of a plan no longer in flight (void, or redelivered)."""
        if (
            result.scheduler_id != self.scheduler_id
            or result.executor_id != self.executor_id
            or result.epoch != self.epoch
            or result.step_id not in self.in_flight
        ):
            return None
        if result.error is None:
            self.last_progress = self.clock()
        while True:
            step_id, entry = self.in_flight.popitem(last=False)
            if step_id == result.step_id:
                return entry

    def in_flight_now(self, plan: StepPlan) -> bool:
        """Whether `plan` is still out and of the current epoch."""
        return plan.step_id in self.in_flight and plan.epoch == self.epoch

    def void(self, epoch: int | None = None) -> None:
        """The executor holds no request state any more: the steps in flight are void, and the
        next plans build on a new epoch (`epoch`: the executor's, when it said which)."""
        self.in_flight.clear()
        self.epoch = self.epoch + 1 if epoch is None else epoch

    def check(self) -> Lapse | None:
        """Declare the steps in flight void after `step_timeout_s` without an answer, and the
        executor lost after `executor_timeout_s` of silence (it then serves nothing). The caller
        recomputes every request either way."""
        now = self.clock()
        if self.executor_id is not None and now - self.last_heard > self.executor_timeout_s:
            log.warning(
                "executor %s not heard from for %.0f s: lost; its requests wait for an executor",
                self.executor_id,
                now - self.last_heard,
            )
            self.executor_id = None
            return Lapse.LOST
        if self.in_flight and now - self.last_progress > self.step_timeout_s:
            log.warning(
                "no answer to step %d for %.0f s: the steps in flight are void; recomputing",
                next(iter(self.in_flight)),
                now - self.last_progress,
            )
            return Lapse.STEP_TIMEOUT
        return None
