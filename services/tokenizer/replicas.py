"""`ReplicaRouting`: the tokenizer's side of engine replicas, without I/O: where each sample
goes (the `Router`), where it runs (`Routes`, journaled as `RequestRouted` records), and the
hand-over of a gone replica's samples. `TokenizerHandler` mixes it in; it reads the handler's
streams and clock, and calls its `on_tokens`, `_end_request` and `_close`.

    kv-events topic    ReplicaStatus / KVEvents -> the router's view (`on_replica`)
    a request opened   each live sample: journal, then its replica's tokenized topic
                       (`_send_samples`, `_route_waiting`); none can take it: it waits
    every REPLICA_CHECK_S  hand over the samples of a replica that is gone, when another can
                       take them; route the waiting ones; end those that waited too long
                       (`check_replicas`)

A sample's events count only from the replica that owns their index (`Routes.accepts`): its
first replica's, then, after a hand-over at index k, no replica's from k until it is routed
again (PENDING), then the new one's. See the README's "Engine replicas and routing".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from parkade.schemas import EngineRequest, ErrorKind, FinishReason, FinishRequest, GeneratedTokens, topics
from parkade.schemas.routing import DEFAULT_REPLICA, KVEvents, ReplicaStatus, RequestRouted
from parkade.services.bus.base import Headers, Outgoing
from parkade.services.common import tracing
from parkade.services.tokenizer.router import Router
from parkade.services.tokenizer.routes import PENDING, Routes, Unrouted

if TYPE_CHECKING:
    from parkade.services.tokenizer.handler import _Open
    from parkade.services.tokenizer.metrics import TokenizerMetrics

log = logging.getLogger(__name__)

# How long a request may wait for a replica to take it before it ends with an error.
REPLICA_WAIT_S = 60.0
REPLICA_CHECK_S = 0.25  # how often the replicas' liveness is looked at
# After a start, how long requests wait for the first replica status (one comes each second)
# before they go to replica 0 regardless: routing blind would send every one of them there.
REPLICA_DISCOVERY_S = 2.5


class ReplicaRouting:
    # The handler's, read here.
    streams: dict[str, _Open]
    clock: Callable[[], float]
    tokenizer_id: str
    caught_up_at: float | None
    metrics: TokenizerMetrics | None
    on_tokens: Callable[..., list[Outgoing]]
    _end_request: Callable[[str, str, ErrorKind], list[Outgoing]]

    def init_routing(self, router: Router | None, replica_wait_s: float, clock: Callable[[], float]) -> None:
        # Which replica runs each sample (router.py decides, routes.py remembers); samples that
        # wait for a replica wait `replica_wait_s` at most.
        self.router = router if router is not None else Router(clock=clock)
        self.routes = Routes()
        self.replica_wait_s = replica_wait_s
        self._next_replica_check = 0.0
        self.started_at = -float("inf")  # see REPLICA_DISCOVERY_S
        self.kv_low: dict[str, int] = {}  # replica -> the kv-events offset a restart reads from

    def on_replica(self, message: ReplicaStatus | KVEvents, offset: int | None = None) -> list[Outgoing]:
        """The kv-events topic: the router's view of the replicas. A restart reads it again from
        each replica's last snapshot (`low_watermarks`)."""
        if isinstance(message, ReplicaStatus):
            self.router.on_status(message)
        else:
            self.router.on_kv_events(message)
        if offset is not None and (
            message.replica not in self.kv_low or (isinstance(message, KVEvents) and message.snapshot)
        ):
            self.kv_low[message.replica] = offset
        return []

    def _send_samples(self, open_: _Open) -> list[Outgoing]:
        """Each live sample to its replica: the one its route names (sent again: it drops a
        request it knows), else the router's choice. Sample 0 first: the later samples find its
        prompt blocks in the prefix cache."""
        out: list[Outgoing] = []
        stream = open_.stream
        for request in stream.engine_requests:
            engine_id = request.request_id
            if engine_id not in stream.live_engine_request_ids():
                continue
            route = self.routes.get(engine_id)
            if route is not None and route.segments and route.replica == PENDING:
                # Handed over before the restart, not routed again yet: it waits here.
                given = stream.output_token_ids(engine_id)[: route.segments[-1][1]]
                resumed = msgspec.structs.replace(request, output_token_ids=given)
                self.routes.unrouted[engine_id] = Unrouted(
                    resumed, stream.request_id, open_.headers, self.clock()
                )
                continue
            if route is not None and route.segments:
                replica, start = route.segments[-1]
                given = stream.output_token_ids(engine_id)[:start]
                if start and len(given) < start:
                    # Its tokens before the hand-over were not read again (they should be: the
                    # generated topic is read from below its first event): it starts over from
                    # what is known, elsewhere.
                    self.router.opened(replica, 0)  # (`_hand_over` counts it off again)
                    out += self._hand_over(engine_id, open_, replica)
                    continue
                self.router.opened(replica, route.prompt_blocks)
                resent = msgspec.structs.replace(request, output_token_ids=given) if given else request
                out.append(self._to_replica(replica, resent, open_.stream.request_id, open_.headers))
                continue
            self.routes.unrouted[engine_id] = Unrouted(
                request, stream.request_id, open_.headers, self.clock()
            )
        return out + self._route_waiting()

    def check_replicas(self) -> list[Outgoing]:
        """After every poll, each REPLICA_CHECK_S: the samples of a replica that is gone (no
        status for the router's timeout, draining, or without an executor that long) are handed
        over; samples that wait are routed while a replica can take them, and answered with an
        error once they waited `replica_wait_s`."""
        now = self.clock()
        if now < self._next_replica_check or self.caught_up_at is None:
            return []
        self._next_replica_check = now + REPLICA_CHECK_S
        out: list[Outgoing] = []
        # NOTE: not within a timeout of catching up: a restarted tokenizer may still be reading
        # old statuses, and would take every replica for gone.
        settled = now - self.caught_up_at >= self.router.replica_timeout_s
        available = {n for n, s in self.router.replicas.items() if self.router.available(s)}
        for name in list(self.router.replicas) if settled else ():
            if name in available or not available:
                # (With no other replica to take them, they wait for this one to come back: it
                # resumes its own from its log.)
                continue
            for engine_id in self.routes.on(name):
                route = self.routes.get(engine_id)
                open_ = self.streams.get(route.request_id) if route is not None else None
                if open_ is not None and engine_id not in self.routes.unrouted:
                    out += self._hand_over(engine_id, open_, name)
        out += self._route_waiting()
        for waiting in list(self.routes.unrouted.values()):
            if now - waiting.since >= self.replica_wait_s and waiting.request_id in self.streams:
                error = f"no engine replica could take this request for {self.replica_wait_s:g} s"
                out += self._end_request(waiting.request_id, error, ErrorKind.UNAVAILABLE)
        return out

    def _hand_over(self, engine_id: str, open_: _Open, old: str) -> list[Outgoing]:
        """Move a sample off replica `old`: it is aborted there (a replica that comes back drops
        it), and waits to be routed with the tokens it has so far (the next replica recomputes
        them and goes on at the next index: nothing skipped or repeated)."""
        stream = open_.stream
        route = self.routes.get(engine_id)
        assert route is not None
        self.router.closed(old, route.prompt_blocks, route.started)
        given = stream.output_token_ids(engine_id)
        request = next(r for r in stream.engine_requests if r.request_id == engine_id)
        resumed = msgspec.structs.replace(request, output_token_ids=given)
        self.routes.unrouted[engine_id] = Unrouted(resumed, stream.request_id, open_.headers, self.clock())
        # From here on no replica's events count, until the next route (its segment starts here).
        self.routes.add(engine_id, stream.request_id, PENDING, len(given))
        log.warning(
            "replica %s is gone: request %s goes on elsewhere after %d tokens", old, engine_id, len(given),
            extra={"request_id": stream.request_id, "replica": old},
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.handovers.inc()
        pending = RequestRouted(
            request_id=engine_id, replica=PENDING, from_index=len(given), tokenizer_id=self.tokenizer_id
        )
        finish = FinishRequest(request_id=engine_id, reason=FinishReason.ABORT)
        # The journal first: a restart must not send it back to `old`, which aborts it.
        return [
            Outgoing(topics.REQUESTS, pending, stream.request_id),
            self._to_replica(old, finish, stream.request_id, open_.headers),
        ]

    def _route_waiting(self) -> list[Outgoing]:
        """Send the samples that wait, in arrival order, while a replica can take them."""
        out: list[Outgoing] = []
        if not self.router.known() and self.clock() - self.started_at < REPLICA_DISCOVERY_S:
            return out
        for engine_id, waiting in list(self.routes.unrouted.items()):
            open_ = self.streams.get(waiting.request_id)
            if open_ is None:
                del self.routes.unrouted[engine_id]
                continue
            request = waiting.request
            tokens = (*request.prompt_token_ids, *request.output_token_ids)
            decision = self.router.route(tokens, cache_salt=request.cache_salt, session_id=open_.session_id)
            if decision is None:
                break  # no replica now: they all wait
            del self.routes.unrouted[engine_id]
            start = len(request.output_token_ids)
            route = self.routes.add(engine_id, waiting.request_id, decision.replica, start)
            route.prompt_blocks = decision.prompt_blocks - decision.predicted_blocks
            self.router.opened(decision.replica, route.prompt_blocks)
            if self.metrics is not None:
                self.metrics.routed(decision.replica, decision.predicted_blocks)
            if tracing.enabled():
                attributes = {
                    "parkade.request_id": waiting.request_id,
                    "parkade.replica": decision.replica,
                    "parkade.router": decision.policy,
                    "parkade.predicted_hit_blocks": decision.predicted_blocks,
                    "parkade.prompt_blocks": decision.prompt_blocks,
                }
                tracing.start_span("route", waiting.headers, attributes=attributes).end()
            routed = RequestRouted(
                request_id=engine_id,
                replica=decision.replica,
                from_index=start,
                tokenizer_id=self.tokenizer_id,
            )
            # The journal first: a restart that finds it sends the sample there again; one that
            # found the sample sent and no journal could route it a second time elsewhere.
            out.append(Outgoing(topics.REQUESTS, routed, waiting.request_id))
            out.append(self._to_replica(decision.replica, request, waiting.request_id, waiting.headers))
        return out

    def _finish_at_replica(
        self, engine_id: str, finish: FinishRequest, request_id: str, headers: Headers
    ) -> list[Outgoing]:
        """A FinishRequest to the replica that runs the sample. A sample no replica holds yet
        gets its final event here."""
        if self.routes.unrouted.pop(engine_id, None) is None:
            replica = self.routes.replica(engine_id) or DEFAULT_REPLICA
            return [self._to_replica(replica, finish, request_id, headers)]
        # (A sample handed over and not re-routed yet: its old replica had its abort already.)
        open_ = self.streams.get(request_id)
        if open_ is None:
            return []
        index = open_.stream.next_index_of(engine_id)
        final = GeneratedTokens(
            request_id=engine_id,
            index=index,
            token_ids=(),
            finish_reason=finish.reason,
            stop_reason=finish.stop_reason,
        )
        return self.on_tokens(final)

    @staticmethod
    def _to_replica(
        replica: str, message: EngineRequest | FinishRequest, key: str, headers: Headers
    ) -> Outgoing:
        return Outgoing(topics.replica_topic(topics.TOKENIZED, replica), message, key, headers)
