"""`Router`: which engine replica runs a request. Pure (no I/O): the tokenizer's handler feeds it
the kv-events topic (`on_status`, `on_kv_events`) and asks it (`route`).

What it knows of each replica (schemas/routing.py): its last `ReplicaStatus` (alive, draining,
serving, load, block size) and the set of prefix blocks its pool caches, by short hash, rebuilt
from its KV events (a new `pool` voids the old set: a restarted replica's stale entries go).

Policies (`POLICIES`):

    kv            fewest uncached prompt blocks + load, among the replicas the load gate lets
                  through (default)
    round-robin   each live replica in turn
    least-loaded  the lightest replica
    session       the replica that served the request's `session_id` before (least-loaded for
                  a new session, or a request without one)

The kv cost of replica r, in blocks (the unit of prefill work):

    cost(r) = uncached prompt blocks(r) + queued prefill blocks(r) + DECODE_WEIGHT x streams(r)

The load gate (as SGLang's router): only replicas whose open streams are within
`balance_factor` x (the lightest's + `balance_slack`) compete, so that one hot prefix cannot pile
every request onto the replica that caches it; the others catch up with it by computing it once.
Ties are broken at random (never "replica 0 always"). A routed prompt's blocks count as cached
there at once (`PREDICTED_TTL_S`), since KV events lag: the next request with the same prefix,
a millisecond later, goes to the same place.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from parkade.schemas.routing import DEFAULT_REPLICA, KVEvents, ReplicaStatus
from parkade.services.common.block_hash import hash_check, salt_root

log = logging.getLogger(__name__)

POLICIES = ("kv", "round-robin", "least-loaded", "session")
DEFAULT_POLICY = "kv"
DEFAULT_REPLICA_TIMEOUT_S = 5.0  # no status for this long: the replica is gone
DEFAULT_BALANCE_FACTOR = 1.5
DEFAULT_BALANCE_SLACK = 4
DECODE_WEIGHT = 1.0  # a running stream's share of the step time, in prefill blocks
PREDICTED_TTL_S = 10.0  # until the replica's KV events confirm a routed prefix (or not)
MAX_SESSIONS = 100_000


@dataclass(eq=False)
class ReplicaState:
    name: str
    status: ReplicaStatus | None = None
    heard_at: float = 0.0  # wall clock of its last status (its own `sent_at`)
    pool: str | None = None
    seq: int = -1
    blocks: set[int] = field(default_factory=set)
    predicted: dict[int, float] = field(default_factory=dict)  # routed prefix blocks -> expiry
    streams: int = 0  # samples routed here and still open (this router's)
    queued_blocks: int = 0  # prompt blocks routed here whose first token has not come yet
    not_serving_since: float | None = None
    compatible: bool = True  # hashes alike (block size known, hash check equal)
    # Counters, for the metrics.
    routed: int = 0
    predicted_hit_blocks: int = 0
    real_hit_blocks: int = 0
    kv_event_bytes: int = 0
    kv_event_lag_s: float = 0.0

    @property
    def block_size(self) -> int:
        return self.status.block_size if self.status is not None else 0

    def holds(self, block: int, now: float) -> bool:
        if block in self.blocks:
            return True
        expiry = self.predicted.get(block)
        return expiry is not None and expiry > now


@dataclass(frozen=True)
class Decision:
    replica: str
    predicted_blocks: int  # prompt blocks expected cached there
    prompt_blocks: int  # full blocks in the prompt
    policy: str


class Router:
    def __init__(
        self,
        policy: str = DEFAULT_POLICY,
        *,
        replica_timeout_s: float = DEFAULT_REPLICA_TIMEOUT_S,
        balance_factor: float = DEFAULT_BALANCE_FACTOR,
        balance_slack: int = DEFAULT_BALANCE_SLACK,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router {policy!r}: one of {', '.join(POLICIES)}")
        if replica_timeout_s <= 0 or balance_factor < 1 or balance_slack < 0:
            raise ValueError("replica_timeout_s must be > 0, balance_factor >= 1, balance_slack >= 0")
        self.policy = policy
        self.replica_timeout_s = replica_timeout_s
        self.balance_factor, self.balance_slack = balance_factor, balance_slack
        self.clock, self.wall_clock = clock, wall_clock
        self.random = random.Random(seed)
        self.replicas: dict[str, ReplicaState] = {}
        self.sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica
        self._turn = itertools.count()
        self._hash_check = hash_check()

    # ---- what the replicas say -----------------------------------------------------------
    def replica(self, name: str) -> ReplicaState:
        state = self.replicas.get(name)
        if state is None:
            state = self.replicas[name] = ReplicaState(name)
        return state

    def on_status(self, status: ReplicaStatus) -> None:
        state = self.replica(status.replica)
        if status.sent_at < state.heard_at:
            return  # an older status read late (a restart reads the topic again)
        if state.pool != status.pool:
            self._new_pool(state, status.pool)
        state.status, state.heard_at = status, status.sent_at
        compatible = status.block_size > 0 and status.hash_check == self._hash_check
        if state.compatible and not compatible and status.block_size > 0:
            log.warning(
                "replica %s hashes its blocks differently (hash check %d, ours %d): routed by load only",
                status.replica, status.hash_check, self._hash_check,
            )  # fmt: skip
        state.compatible = compatible
        if status.serving:
            state.not_serving_since = None
        elif state.not_serving_since is None:
            state.not_serving_since = status.sent_at

    def on_kv_events(self, events: KVEvents) -> None:
        state = self.replica(events.replica)
        if events.pool != state.pool:
            if not events.snapshot:
                return  # of a pool that is gone, or not announced by a snapshot yet
            self._new_pool(state, events.pool)
        elif events.seq <= state.seq:
            return  # read again
        if events.snapshot:
            state.blocks = set(events.stored)
        else:
            state.blocks.update(events.stored)
            state.blocks.difference_update(events.removed)
        for block in events.stored:
            state.predicted.pop(block, None)
        state.seq = events.seq
        state.kv_event_bytes += 8 * (len(events.stored) + len(events.removed)) + 64
        if events.sent_at:
            state.kv_event_lag_s = max(0.0, self.wall_clock() - events.sent_at)

    @staticmethod
    def _new_pool(state: ReplicaState, pool: str) -> None:
        state.pool, state.seq = pool, -1
        state.blocks, state.predicted = set(), {}

    # ---- who is there --------------------------------------------------------------------
    def alive(self, state: ReplicaState, now_wall: float | None = None) -> bool:
        """Heard from within the timeout and not draining."""
        if state.status is None or state.status.draining:
            return False
        now_wall = self.wall_clock() if now_wall is None else now_wall
        return now_wall - state.heard_at < self.replica_timeout_s

    def available(self, state: ReplicaState, now_wall: float | None = None) -> bool:
        """Alive, and its executor serves (or stopped serving less than the timeout ago)."""
        now_wall = self.wall_clock() if now_wall is None else now_wall
        if not self.alive(state, now_wall):
            return False
        since = state.not_serving_since
        return since is None or now_wall - since < self.replica_timeout_s

    def candidates(self) -> list[ReplicaState]:
        """The replicas a request may go to now: those serving; else the alive ones (their
        scheduler holds a request until an executor comes)."""
        now_wall = self.wall_clock()
        alive = [s for s in self.replicas.values() if self.alive(s, now_wall)]
        serving = [s for s in alive if s.status is not None and s.status.serving]
        return sorted(serving or alive, key=lambda s: s.name)

    def known(self) -> bool:
        """Whether any replica ever announced itself (before that, everything goes to replica 0)."""
        return any(s.status is not None for s in self.replicas.values())

    # ---- routing -------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
        """The prompt's full blocks, hashed as the scheduler hashes them (its own function),
        as short hashes."""
        # NOTE: `hash_block` over one buffer of the whole prompt, sliced (the same bytes it
        # hashes, without a tuple and an array per block): an 8k-token prompt in about 0.5 ms on
        # the developer VM, where a tuple and an array per block took 1.3 ms.
        data = array("q", token_ids).tobytes()
        width = 8 * block_size
        parent = salt_root(cache_salt) or b""
        out: list[int] = []
        sha256, from_bytes = hashlib.sha256, int.from_bytes  # (`short_hash`, inlined: 500 calls)
        for start in range(0, len(data) - width + 1, width):
            parent = sha256(parent + data[start : start + width]).digest()
            out.append(from_bytes(parent[:8], "big", signed=True))
        return out

    def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Decision | None:
        """Where a request with this prompt goes; None when no replica can take it now."""
        if not self.known():
            return Decision(DEFAULT_REPLICA, 0, 0, "default")
        candidates = self.candidates()
        if not candidates:
            return None
        now = self.clock()
        hashes: dict[int, list[int]] = {}
        for state in candidates:
            size = state.block_size
            if size > 0 and state.compatible and size not in hashes:
                hashes[size] = self.block_hashes(token_ids, size, cache_salt)
        chosen = self._choose(candidates, hashes, session_id, now)
        blocks = hashes.get(chosen.block_size, []) if chosen.compatible else []
        # As the scheduler's `match_prefix`: the last prompt token is always computed.
        usable = (len(token_ids) - 1) // chosen.block_size if chosen.block_size else 0
        predicted = min(self._matched(chosen, blocks, now), usable)
        chosen.routed += 1
        chosen.predicted_hit_blocks += predicted
        chosen.predicted.update(dict.fromkeys(blocks, now + PREDICTED_TTL_S))  # at once: events lag
        if len(chosen.predicted) > 4 * max(len(chosen.blocks), 4096):
            chosen.predicted = {b: t for b, t in chosen.predicted.items() if t > now}
        if session_id is not None:
            self.sessions[session_id] = chosen.name
            self.sessions.move_to_end(session_id)
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return Decision(chosen.name, predicted, len(blocks), self.policy)

    def _choose(
        self, candidates: list[ReplicaState], hashes: dict[int, list[int]], session_id: str | None, now: float
    ) -> ReplicaState:
        if self.policy == "round-robin":
            return candidates[next(self._turn) % len(candidates)]
        if self.policy == "session" and session_id is not None:
            name = self.sessions.get(session_id)
            sticky = next((s for s in candidates if s.name == name), None)
            if sticky is not None:
                return sticky
        if self.policy in ("least-loaded", "session"):
            return self._pick(candidates, lambda s: s.streams + s.queued_blocks / 64)
        lightest = min(s.streams for s in candidates)
        gate = self.balance_factor * (lightest + self.balance_slack)
        allowed = [s for s in candidates if s.streams <= gate]

        def cost(state: ReplicaState) -> float:
            blocks = hashes.get(state.block_size, []) if state.compatible else []
            uncached = len(blocks) - self._matched(state, blocks, now)
            return uncached + state.queued_blocks + DECODE_WEIGHT * state.streams

        return self._pick(allowed, cost)

    def _pick(self, candidates: list[ReplicaState], cost: Callable[[ReplicaState], float]) -> ReplicaState:
        costs = [(cost(s), s) for s in candidates]
        best = min(c for c, _ in costs)
        return self.random.choice([s for c, s in costs if c <= best + 1e-9])

    @staticmethod
    def _matched(state: ReplicaState, blocks: list[int], now: float) -> int:
        """How many of the prompt's leading blocks the replica holds (or was just sent)."""
        matched = 0
        for block in blocks:
            if not state.holds(block, now):
                break
            matched += 1
        return matched

    # ---- what the tokenizer tells it -----------------------------------------------------
    def opened(self, replica: str, prompt_blocks: int) -> None:
        state = self.replica(replica)
        state.streams += 1
        state.queued_blocks += prompt_blocks

    def first_token(self, replica: str, prompt_blocks: int, cached_tokens: int) -> None:
        state = self.replica(replica)
        state.queued_blocks = max(0, state.queued_blocks - prompt_blocks)
        if state.block_size:
            state.real_hit_blocks += cached_tokens // state.block_size

    def closed(self, replica: str, prompt_blocks: int, started: bool) -> None:
        state = self.replica(replica)
        state.streams = max(0, state.streams - 1)
        if not started:
            state.queued_blocks = max(0, state.queued_blocks - prompt_blocks)
