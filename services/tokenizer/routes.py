"""`Routes`: where each live sample runs, as the tokenizer decided it (pure).

A sample's route is a list of segments (replica, from_index): it ran on the first replica from
index 0, and on each later one from the index at which it was handed over. An event of a
sample is the sample's only if it comes from the replica of the segment its index falls in:

    segments  [("a", 0), ("b", 7)]     a's events at index < 7 count, b's from 7 on; a's final
                                       event (the abort sent to it at the hand-over, index >= 7)
                                       does not
              [("a", 0), ("", 7)]      handed over at 7, no replica has it yet (PENDING): a's
                                       events from 7 on do not count either

Every decision is journaled as a `RequestRouted` record on the requests topic, which the
tokenizer reads: a restarted tokenizer rebuilds the routes of the requests it reads again from
its predecessor's records before it sends anything (see the handler's module).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parkade.schemas import EngineRequest
from parkade.schemas.routing import DEFAULT_REPLICA
from parkade.services.bus.base import Headers

PENDING = ""  # a segment's replica while a handed-over sample waits for another one


@dataclass(eq=False)
class Route:
    request_id: str  # the client's request id (the sample's stream)
    segments: list[tuple[str, int]] = field(default_factory=list)
    prompt_blocks: int = 0  # what the router counts as queued prefill until the first token
    started: bool = False  # its first event from the current replica came

    @property
    def replica(self) -> str:
        return self.segments[-1][0]

    def owner(self, index: int) -> str:
        """The replica whose events at `index` are the sample's: of the last segment that starts
        at or below it (a later route overrides an earlier one from its start on)."""
        return next((r for r, start in reversed(self.segments) if start <= index), self.segments[0][0])


@dataclass(eq=False)
class Unrouted:
    """A sample that waits to be sent: no replica can take it now, or the tokenizer is still
    reading its predecessor's routing journal."""

    request: EngineRequest
    request_id: str
    headers: Headers
    since: float  # monotonic clock


class Routes:
    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}  # engine (sample) id -> its route
        self.unrouted: dict[str, Unrouted] = {}  # engine id -> the sample, in arrival order

    def get(self, engine_id: str) -> Route | None:
        return self.routes.get(engine_id)

    def replica(self, engine_id: str) -> str | None:
        """The replica that runs the sample now (None: none yet, or none since a hand-over)."""
        route = self.routes.get(engine_id)
        return route.replica or None if route is not None and route.segments else None

    def accepts(self, engine_id: str, replica: str | None, index: int) -> bool:
        """Whether an event of `replica` at `index` is the sample's (None: made here)."""
        route = self.routes.get(engine_id)
        if replica is None or route is None or not route.segments:
            return True
        return route.owner(index) == (replica or DEFAULT_REPLICA)

    def add(self, engine_id: str, request_id: str, replica: str, from_index: int) -> Route:
        route = self.routes.get(engine_id)
        if route is None:
            route = self.routes[engine_id] = Route(request_id)
        if route.segments and route.segments[-1] == (replica, from_index):
            return route  # read again
        route.segments.append((replica, from_index))
        route.started = False
        return route

    def on(self, replica: str) -> list[str]:
        """The samples whose current replica is `replica`."""
        return [e for e, r in self.routes.items() if r.segments and r.replica == replica]

    def forget(self, engine_id: str) -> Route | None:
        self.unrouted.pop(engine_id, None)
        return self.routes.pop(engine_id, None)
