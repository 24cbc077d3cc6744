"""`LiveRequest`: everything the scheduler service knows about one live request, in one record.

The pure core (`Scheduler`) keeps its own `Request` for scheduling and nothing of the service's.
This record holds the rest: what the request's records carry on (headers), where it is in the
log for a restart, what it generated before one, its failures and deadlines, its spans and its
metric timestamps. A request is live from its first sight (its record on the tokenized topic, or
its events read back by `recover`) to its final event; ending it is one removal
(`LiveRequests.end`), so a leak is one forgotten key, not fifteen.

    tokenized record ──► LiveRequest ──(an executor serves)──► Scheduler.add ──► ... final event
          (or recover)     `request`, no core entry yet          core entry          record removed
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence, ValuesView
from dataclasses import dataclass
from typing import Any

from parkade.schemas import EngineRequest
from parkade.schemas.routing import DEFAULT_REPLICA
from parkade.services.bus.base import Headers
from parkade.services.common.recent import RecentIds
from parkade.services.scheduler.recovery import read_back

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class LiveRequest:
    request_id: str
    # An offset of the generated topic at or below the request's first event: a restart reads
    # the generated topic from the lowest of these (`SchedulerHandler.progress`).
    generated_start: int
    # The request as the tokenizer sent it; None while only its events were read back (`recover`)
    # and its tokenized record is not read again yet.
    request: EngineRequest | None = None
    headers: Headers = ()  # its trace context, passed on with every record about it
    source: int | None = None  # its record's offset on the tokenized topic (None: not from the log)
    # The tokens it generated before a restart (read back by `recover`; [] when its history was
    # cut), until the core resumes it with them. None: not a recovered request. A recovered one
    # was admitted before the restart, so it is never refused as overloaded.
    outputs: list[int] | None = None
    outputs_from: int = 0  # the index of outputs[0]: > 0 for a hand-over read back (see `resume`)
    # Since when it has waited without an executor to run it (None: an executor serves it).
    waiting_since: float | None = None
    failures: int = 0  # failed steps in a row it was in
    isolate: bool = False  # a suspect of a failed step: its next admission is a step of its own
    # Tracing (services/scheduler/spans.py), while it is on.
    span: Any = None  # scheduler.request
    queue_span: Any = None  # scheduler.queue, until its first admission
    first_token_seen: bool = False
    # Metrics (services/scheduler/metrics.py), while they are on: wall-clock seconds.
    arrival_time: float | None = None  # from the front end, until its first admission
    started: float | None = None  # the same, kept to its end: TTFT and e2e latency
    last_token_time: float | None = None  # when its last token came: inter-token latency

    @property
    def num_outputs_before(self) -> int:
        """Tokens generated before a restart that the core has not taken over yet: the index of
        an event written for it before the core knows it."""
        return self.outputs_from + len(self.outputs) if self.outputs is not None else 0

    def resume(self, given: Sequence[int]) -> None:
        """Its tokenized record is read: join `given` (the tokens it generated on other replicas
        before it was handed over here: `EngineRequest.output_token_ids`) and what this replica's
        log had (from `outputs_from`), into its outputs from index 0."""
        if self.outputs is None:
            if given:
                self.outputs = list(given)
            return
        if self.outputs_from > len(given):
            # Its first events are below the saved progress (the progress rule excludes it) or
            # another replica's history is missing: it starts again from what is known.
            log.error("request %s: its outputs before index %d are unknown; it starts again from %d",
                      self.request_id, self.outputs_from, len(given))  # fmt: skip
            self.outputs = list(given)
        else:
            self.outputs = [*given, *self.outputs[len(given) - self.outputs_from :]]
        self.outputs_from = 0


class LiveRequests(Mapping[str, LiveRequest]):
    """The live requests by id, the ids that ended lately, and the bounds a restart reads the
    log within (see the handler's module): the tokenized topic from the oldest live request's
    record (`low_watermark`), the generated topic from below every live request's first event
    (`progress`)."""

    def __init__(self) -> None:
        self._records: dict[str, LiveRequest] = {}
        # An index of the records read while no executor served, in the order they were read,
        # until the core takes them (`admitted`) or they end.
        self.pending: dict[str, LiveRequest] = {}
        self.finished = RecentIds()  # ended requests, with their record's offset: redeliveries
        self.generated_end = 0  # the offset after the last generated record acknowledged

    def __getitem__(self, request_id: str) -> LiveRequest:
        return self._records[request_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    # NOTE: the dict's own methods rather than Mapping's mixins, which are Python loops: `get`
    # runs for every event written, and `list(live.values())` copies at once under the GIL (the
    # metrics server's thread reads it while the event loop changes the records).
    def __contains__(self, request_id: object) -> bool:
        return request_id in self._records

    def get(self, request_id: str, default: None = None) -> LiveRequest | None:  # type: ignore[override]
        return self._records.get(request_id, default)

    def values(self) -> ValuesView[LiveRequest]:
        return self._records.values()

    def open(self, request_id: str) -> LiveRequest:
        """A new record; its events will be written after what was acknowledged so far."""
        record = self._records[request_id] = LiveRequest(request_id, generated_start=self.generated_end)
        return record

    def wait(self, record: LiveRequest) -> None:
        """A read request waits for an executor (none serves)."""
        self.pending[record.request_id] = record

    def admitted(self, record: LiveRequest) -> None:
        """The core took it."""
        self.pending.pop(record.request_id, None)

    def end(self, record: LiveRequest) -> None:
        """Its final event is written: its record goes (with its place in the pending index),
        and its id is remembered with its source."""
        del self._records[record.request_id]
        self.pending.pop(record.request_id, None)
        self.finished.add(record.request_id, record.source)

    def recover(self, start: int, messages: Iterable[object], replica: str = DEFAULT_REPLICA) -> int:
        """Read back the generated topic's records from offset `start` (see `read_back`): the
        requests that finished are remembered, the live ones get a record with their outputs
        (until their tokenized record is read again). -> how many are live."""
        self.generated_end = start
        finished, outputs = read_back(messages, start, replica)
        for request_id in finished:
            self.finished.add(request_id)
        for request_id, (first, tokens) in outputs.items():
            record = self.open(request_id)  # its events start at or after `start`
            record.outputs, record.outputs_from = tokens, first
        return len(outputs)

    def acknowledged(self, offset: int) -> None:
        """A record of the generated topic was acknowledged at `offset`."""
        self.generated_end = max(self.generated_end, offset + 1)

    def low_watermark(self) -> int | None:
        """The oldest tokenized record a restart must read again (None: none)."""
        return min((r.source for r in self._records.values() if r.source is not None), default=None)

    def progress(self) -> int:
        """Where a restart reads the generated topic from: below every live request's events,
        those recovered and not read again yet included."""
        return min((r.generated_start for r in self._records.values()), default=self.generated_end)
