"""Engine replicas and routing: what each replica says about itself, and the tokenizer's journal
of where it sent each request.

    kv-events topic   ReplicaStatus   each replica, every second: alive, load, pool geometry
                      KVEvents        the prefix blocks its pool stored and dropped (by hash)
    requests topic    RequestRouted   the tokenizer's routing journal (it reads its own topic)

A replica is a scheduler and its executor with their KV pool; `replica` is its stable name
(it survives the replica's own restart). Its block hashes are the scheduler's chained sha256
block hashes cut to their first 8 bytes (`short_hash`), which is all the router keeps.
"""

from __future__ import annotations

import re

import msgspec

# A replica's name: it becomes part of topic names (see topics.replica_topic).
REPLICA_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
DEFAULT_REPLICA = "0"


def check_replica_name(name: str) -> str:
    if not REPLICA_NAME.fullmatch(name):
        raise ValueError(f"replica name {name!r}: 1 to 32 of A-Z a-z 0-9 _ -")
    return name


def short_hash(block_hash: bytes) -> int:
    """The first 8 bytes of a chained block hash, as a signed 64-bit int (msgpack-compact). A
    collision costs a wrong routing guess, never wrong K/V: the scheduler confirms every hit."""
    return int.from_bytes(block_hash[:8], "big", signed=True)


class ReplicaStatus(msgspec.Struct, frozen=True, kw_only=True, tag="replica_status"):
    """A replica's heartbeat, with its load and its pool's identity. `pool` changes whenever the
    replica's cached blocks all went (a restart, a new executor): KV entries of another pool are
    void. `hash_check` is `short_hash` of a reference block (`routing.HASH_CHECK_BLOCK`), so a
    router that would hash differently notices at once."""

    replica: str
    scheduler_id: str
    pool: str
    sent_at: float  # wall-clock seconds
    block_size: int = 0  # 0: no executor has announced its pool yet
    hash_check: int = 0
    serving: bool = False  # an executor serves it
    draining: bool = False  # stopping: route nothing more here
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0  # prompt tokens looked up at admissions, since the scheduler started
    prefix_hits: int = 0  # of them, found in its prefix cache
    kv_seq: int = -1  # the last KVEvents sequence number sent for this pool


class KVEvents(msgspec.Struct, frozen=True, kw_only=True, tag="kv_events"):
    """Blocks of one pool stored in and removed from its prefix cache, in order (`seq` counts
    from 0 per pool). A `snapshot` lists every cached block, and replaces what was known."""

    replica: str
    pool: str
    seq: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    snapshot: bool = False
    sent_at: float = 0.0


class RequestRouted(msgspec.Struct, frozen=True, kw_only=True, tag="request_routed"):
    """The tokenizer sent the sample `request_id` (an engine request id) to `replica`, whose
    events count from `from_index` on (0: its first route; more: a hand-over after that many
    tokens). Events of any other replica at or past `from_index` are void. `replica` "": handed
    over, waiting for a replica to take it (no replica's events count from `from_index` on)."""

    request_id: str
    replica: str
    from_index: int = 0
    tokenizer_id: str = ""
