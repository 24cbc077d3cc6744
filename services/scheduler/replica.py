"""`ReplicaPublisher`: what an engine replica's scheduler tells the routers, on the kv-events
topic (schemas/routing.py). Pure: the handler sends what `records` returns.

    every STATUS_INTERVAL_S   ReplicaStatus   alive, load, pool geometry, prefix-cache counters
    every KV_EVENT_INTERVAL_S KVEvents        the blocks its prefix cache stored and dropped since
                                              (a snapshot of all of them for a new pool, and every
                                              SNAPSHOT_EVERY records)

Keys, for a compacted topic (Apache Kafka; Tansu keeps everything): `R/status`, `R/snapshot`,
and `R/delta/<seq mod DELTA_KEYS>`, so compaction keeps the last snapshot and the deltas after
it (DELTA_KEYS > SNAPSHOT_EVERY), which is all a router that starts reads back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from parkade.schemas import topics
from parkade.schemas.routing import KVEvents, ReplicaStatus, short_hash
from parkade.services.bus.base import Outgoing
from parkade.services.common.block_hash import hash_check
from parkade.services.scheduler.block_pool import BlockPool, CacheEvents
from parkade.services.scheduler.scheduler import Scheduler

STATUS_INTERVAL_S = 1.0
KV_EVENT_INTERVAL_S = 0.05  # the events' lag: the router counts what it routes at once anyway
SNAPSHOT_EVERY = 64
DELTA_KEYS = 128


class ReplicaPublisher:
    def __init__(
        self,
        replica: str,
        scheduler_id: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.replica, self.scheduler_id = replica, scheduler_id
        self.clock, self.wall_clock = clock, wall_clock
        self.pool_count = 0
        self.pool_id = f"{scheduler_id}.0"  # no pool yet
        self.block_pool: BlockPool | None = None
        self.events: CacheEvents | None = None
        self.seq = -1  # the last KVEvents sent for this pool
        self.last_snapshot = -1
        self.draining = False
        self._next_status = 0.0
        self._next_kv = 0.0
        self.bytes_sent = 0  # KV-event payload, estimated (8 bytes a block): for the metrics

    def attach(self, pool: BlockPool) -> None:
        """A new pool (a scheduler built on an executor's geometry): its events start over."""
        self.block_pool, self.events = pool, CacheEvents()
        pool.events = self.events
        self._new_pool()

    def _new_pool(self) -> None:
        self.pool_count += 1
        self.pool_id = f"{self.scheduler_id}.{self.pool_count}"
        self.seq, self.last_snapshot = -1, -1

    def records(
        self, scheduler: Scheduler | None, *, serving: bool, num_pending: int, force: bool = False
    ) -> list[Outgoing]:
        """What is due now (`force`: the status and any events, at once)."""
        now, out = self.clock(), []
        if self.events is not None and (force or now >= self._next_kv):
            self._next_kv = now + KV_EVENT_INTERVAL_S
            out += self._kv_events()
        if force or now >= self._next_status:
            self._next_status = now + STATUS_INTERVAL_S
            out.append(self._status(scheduler, serving, num_pending))
        return out

    def _kv_events(self) -> list[Outgoing]:
        assert self.events is not None and self.block_pool is not None
        stored, removed, cleared = self.events.take()
        if cleared:
            self._new_pool()  # every block went: a new pool as far as routers know
        snapshot = self.seq < 0 or self.seq - self.last_snapshot >= SNAPSHOT_EVERY
        if not (snapshot or stored or removed):
            return []
        self.seq += 1
        if snapshot:
            self.last_snapshot = self.seq
            message = KVEvents(
                replica=self.replica,
                pool=self.pool_id,
                seq=self.seq,
                stored=tuple(short_hash(h) for h in self.block_pool.cached_hashes()),
                snapshot=True,
                sent_at=self.wall_clock(),
            )
            key = f"{self.replica}/snapshot"
        else:
            message = KVEvents(
                replica=self.replica,
                pool=self.pool_id,
                seq=self.seq,
                stored=tuple(short_hash(h) for h in stored),
                removed=tuple(short_hash(h) for h in removed),
                sent_at=self.wall_clock(),
            )
            key = f"{self.replica}/delta/{self.seq % DELTA_KEYS}"
        self.bytes_sent += 8 * (len(message.stored) + len(message.removed)) + 64
        return [Outgoing(topics.KV_EVENTS, message, key)]

    def _status(self, scheduler: Scheduler | None, serving: bool, num_pending: int) -> Outgoing:
        stats = scheduler.stats() if scheduler is not None else None
        message = ReplicaStatus(
            replica=self.replica,
            scheduler_id=self.scheduler_id,
            pool=self.pool_id,
            sent_at=self.wall_clock(),
            block_size=scheduler.config.block_size if scheduler is not None else 0,
            hash_check=hash_check(),
            serving=serving and scheduler is not None,
            draining=self.draining,
            num_running=stats.num_running if stats else 0,
            num_waiting=(stats.num_waiting if stats else 0) + num_pending,
            num_blocks=(stats.num_used_blocks + stats.num_free_blocks) if stats else 0,
            num_free_blocks=stats.num_free_blocks if stats else 0,
            prefix_queries=stats.num_prefix_queries if stats else 0,
            prefix_hits=stats.num_prefix_hits if stats else 0,
            kv_seq=self.seq,
        )
        return Outgoing(topics.KV_EVENTS, message, f"{self.replica}/status")
