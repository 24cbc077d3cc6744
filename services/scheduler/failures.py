"""`StepFailures`: which live requests are suspected of making the executor's steps fail, and
when one has failed too often. Service policy over the records (`LiveRequest.failures`,
`.isolate`); the core only offers the mechanism (`Scheduler.schedule(isolate=...)`).

A step that fails counts one failure for each request in it. A request in `MAX_STEP_FAILURES`
failed steps in a row ends with the error. After its first, it is isolated: its next admission
is a step of its own, so a request the model cannot run fails alone twice more, while one that
only shared a step with it (or met a passing fault) succeeds there, samples a token, and starts
counting again.
"""

from __future__ import annotations

from parkade.schemas import StepPlan
from parkade.services.scheduler.live import LiveRequest, LiveRequests

MAX_STEP_FAILURES = 3


class StepFailures:
    def __init__(self, live: LiveRequests) -> None:
        self.live = live
        # Some live request may be isolated: only then are the records scanned (a failed step
        # is rare; every step is not).
        self._suspects = False

    def failed(self, plan: StepPlan) -> list[LiveRequest]:
        """`plan` failed: a failure each for its requests; -> those at `MAX_STEP_FAILURES`, to
        end (the others are isolated)."""
        ended = []
        for request_id in plan.num_scheduled_tokens:
            record = self.live.get(request_id)
            if record is None:
                continue
            record.failures += 1
            if record.failures >= MAX_STEP_FAILURES:
                ended.append(record)
            else:
                record.isolate = self._suspects = True
        return ended

    def sampled(self, request_ids: tuple[str, ...]) -> None:
        """A step's result: its requests sampled a token, so they batch again from zero."""
        if not self._suspects:
            return
        for request_id in request_ids:
            record = self.live.get(request_id)
            if record is not None:
                record.failures, record.isolate = 0, False

    def isolated(self) -> frozenset[str]:
        """The suspects still to run a step of their own (`Scheduler.schedule`'s `isolate`)."""
        if not self._suspects:
            return frozenset()
        isolated = frozenset(r.request_id for r in self.live.values() if r.isolate)
        self._suspects = bool(isolated)
        return isolated
