"""The router (services/tokenizer/router.py) and the tokenizer's routing: policies, the load gate,
tie breaks, KV events with pool epochs, hand-overs, and a restart that reads the journal."""

from __future__ import annotations

import msgspec
import pytest

from parkade.schemas import (
    AbortRequest,
    FinishReason,
    FinishRequest,
    GeneratedBatch,
    GeneratedTokens,
    GenerateRequest,
    KVEvents,
    ReplicaStatus,
    RequestRouted,
    SamplingParams,
    TokenizerAnnouncement,
    topics,
)
from parkade.schemas.routing import short_hash
from parkade.services.common.block_hash import hash_check
from parkade.services.scheduler.block_pool import BlockPool
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.handler import SchedulerHandler
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.handler import TokenizerHandler
from parkade.services.tokenizer.router import Router

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def status(name: str, clock: Clock, *, pool: str | None = None, **fields) -> ReplicaStatus:
    values = dict(block_size=BLOCK, hash_check=hash_check(), serving=True)
    values.update(fields)
    return ReplicaStatus(replica=name, scheduler_id=name, pool=pool or f"{name}.1", sent_at=clock(), **values)


def router(policy: str = "kv", names=("a", "b", "c"), **kwargs) -> tuple[Router, Clock]:
    clock = Clock()
    r = Router(policy, clock=clock, wall_clock=clock, seed=0, **kwargs)
    for name in names:
        r.on_status(status(name, clock))
    return r, clock


def cached(r: Router, name: str, tokens, *, seq: int = 0, pool: str | None = None) -> None:
    blocks = tuple(r.block_hashes(tokens, BLOCK, None))
    r.on_kv_events(
        KVEvents(replica=name, pool=pool or f"{name}.1", seq=seq, stored=blocks, snapshot=seq == 0)
    )


PROMPT = list(range(100, 132))  # 8 blocks


def test_kv_sends_a_prompt_where_its_prefix_is_cached_and_counts_it_there_at_once():
    r, _ = router()
    cached(r, "b", PROMPT[:24])
    decision = r.route(PROMPT)
    assert (decision.replica, decision.predicted_blocks, decision.prompt_blocks) == ("b", 6, 8)
    r.opened("b", 2)
    # The next one with the same prefix, before any KV event: b again, every block predicted but
    # the last (its last token is always computed, as the scheduler's match_prefix has it).
    assert r.route(PROMPT).predicted_blocks == 7
    assert r.route([*PROMPT, 1]).predicted_blocks == 8
    # Another salt never matches.
    assert r.route(PROMPT, cache_salt="tenant").predicted_blocks == 0


def test_the_scheduler_and_the_router_hash_alike():
    """The blocks a scheduler's pool registers (its KV events) are the router's hashes of the
    same tokens, salt included."""
    from parkade.schemas import EngineRequest
    from parkade.services.scheduler.request import Request

    for salt in (None, "s"):
        request = Request(
            EngineRequest(
                request_id="x",
                prompt_token_ids=tuple(PROMPT),
                sampling_params=SamplingParams(),
                cache_salt=salt,
            ),
            BLOCK,
        )
        r, _ = router()
        assert r.block_hashes(PROMPT, BLOCK, salt) == [short_hash(h) for h in request.update_block_hashes()]


def test_the_load_gate_spreads_one_hot_prefix_and_ties_are_random():
    r, _ = router()
    cached(r, "a", PROMPT)
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(300):
        decision = r.route(PROMPT)
        r.opened(decision.replica, 0)
        counts[decision.replica] += 1
    assert max(counts.values()) / min(counts.values()) <= 1.5, counts
    # No prefix anywhere, no load: ties, broken at random (not always the first replica).
    fresh, _ = router()
    assert len({fresh.route([1, 2, 3]).replica for _ in range(40)}) == 3


def test_round_robin_least_loaded_and_session():
    r, _ = router("round-robin")
    assert [r.route(PROMPT).replica for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    r, _ = router("least-loaded")
    r.opened("a", 0)
    r.opened("b", 0)
    assert r.route(PROMPT).replica == "c"
    r, _ = router("session")
    first = r.route(PROMPT, session_id="s1").replica
    r.opened(first, 0)
    r.opened(first, 0)
    assert all(r.route([7], session_id="s1").replica == first for _ in range(5))
    with pytest.raises(ValueError, match="one of"):
        Router("random")


def test_a_new_pool_voids_a_replicas_blocks_and_stale_events_are_dropped():
    r, clock = router()
    cached(r, "b", PROMPT)
    assert r.route(PROMPT).replica == "b"
    clock.now += 1
    r.on_status(status("b", clock, pool="b.2"))  # restarted: its cache is empty
    state = r.replicas["b"]
    assert not state.blocks and not state.predicted
    cached(r, "b", PROMPT, seq=3, pool="b.1")  # an old pool's delta read late: ignored
    assert not state.blocks
    r.on_kv_events(KVEvents(replica="b", pool="b.2", seq=0, stored=(1, 2), snapshot=True))
    r.on_kv_events(KVEvents(replica="b", pool="b.2", seq=1, stored=(3,), removed=(1,)))
    r.on_kv_events(KVEvents(replica="b", pool="b.2", seq=1, stored=(9,)))  # read again
    assert state.blocks == {2, 3}


def test_replicas_that_are_silent_draining_without_an_executor_or_hashing_otherwise():
    r, clock = router(replica_timeout_s=5)
    clock.now += 3
    r.on_status(status("a", clock))
    r.on_status(status("b", clock, draining=True))
    r.on_status(status("c", clock, hash_check=123))  # another hash: routed by load only
    assert [s.name for s in r.candidates()] == ["a", "c"]
    cached(r, "c", PROMPT)
    assert r.route(PROMPT).predicted_blocks == 0 or r.route(PROMPT).replica == "a"
    clock.now += 4  # a heard 4 s ago, c too: both alive
    r.on_status(status("c", clock, serving=False))
    assert [s.name for s in r.candidates()] == ["a"]  # serving ones first
    clock.now += 2.5  # a silent for 6.5 s: gone; c alive, without an executor
    assert r.candidates() == [r.replicas["c"]] and not r.available(r.replicas["a"])
    clock.now += 10
    assert r.route(PROMPT) is None  # nobody: the request waits


def test_a_scheduler_publishes_its_status_and_the_blocks_its_pool_caches():
    clock = Clock()
    handler = SchedulerHandler(SchedulingOptions(), replica="b", clock=clock)
    handler.publisher.clock = handler.publisher.wall_clock = clock
    from parkade.schemas import EngineRequest, ExecutorAnnouncement

    handler.on_announcement(
        ExecutorAnnouncement(
            executor_id="e", num_blocks=32, block_size=BLOCK, max_model_len=128, vocab_size=500
        )
    )
    request = EngineRequest(request_id="x", prompt_token_ids=tuple(PROMPT), sampling_params=SamplingParams())
    handler.on_tokenized(request)
    out = handler.after_batch()
    kinds = [type(o.message).__name__ for o in out if o.topic == topics.KV_EVENTS]
    assert kinds == ["KVEvents", "ReplicaStatus"]
    (snapshot,) = [o.message for o in out if isinstance(o.message, KVEvents)]
    (status_,) = [o.message for o in out if isinstance(o.message, ReplicaStatus)]
    assert snapshot.snapshot and snapshot.seq == 0 and snapshot.pool == status_.pool
    assert (status_.replica, status_.block_size, status_.hash_check) == ("b", BLOCK, hash_check())
    # Scheduled blocks are registered (and published) at once: the router's hashes of the prompt.
    r, _ = router()
    assert set(r.block_hashes(PROMPT, BLOCK, None)) <= set(snapshot.stored)
    assert handler.after_batch() == []  # nothing new, nothing due
    clock.now += 1
    (beat,) = [o.message for o in handler.after_batch() if o.topic == topics.KV_EVENTS]
    assert isinstance(beat, ReplicaStatus) and beat.num_running == 1
    pool = BlockPool(4)
    assert pool.events is None  # nothing recorded unless a replica publishes


@pytest.fixture(scope="module")
def frontend():
    return FrontEnd.from_options(TokenizerOptions())


def _tokenizer(frontend, clock: Clock, **kwargs) -> TokenizerHandler:
    r = Router("kv", clock=clock, wall_clock=clock, seed=1, replica_timeout_s=5)
    handler = TokenizerHandler(frontend, router=r, clock=clock, **kwargs)
    for name in ("a", "b"):
        handler.on_replica(status(name, clock), 0)
    return handler


def _request(rid: str = "r") -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt="Once upon a time", sampling_params=SamplingParams(max_tokens=50)
    )


def test_a_gone_replicas_stream_goes_on_elsewhere_from_where_it_was(frontend):
    clock = Clock()
    tok = _tokenizer(frontend, clock)
    journal, sent = tok.on_request(_request(), (), (topics.topic_name(topics.REQUESTS), 0, 3))
    assert isinstance(journal.message, RequestRouted) and journal.topic == topics.REQUESTS
    first = journal.message.replica
    other = "b" if first == "a" else "a"
    assert sent.topic == topics.replica_topic(topics.TOKENIZED, first)
    tok.on_generated(
        GeneratedBatch(events=(GeneratedTokens(request_id="r", index=0, token_ids=(5, 6, 7)),), replica=first)
    )
    clock.now += 6
    tok.on_replica(status(other, clock), 1)  # only the other one is heard from
    out = tok.after_batch()
    moved = [o for o in out if o.topic == topics.replica_topic(topics.TOKENIZED, other)]
    aborted = [o for o in out if o.topic == topics.replica_topic(topics.TOKENIZED, first)]
    journal = [o.message for o in out if isinstance(o.message, RequestRouted)]
    # Journaled as handed over (no replica's events from 3 on count), then routed again.
    assert [(r.replica, r.from_index) for r in journal] == [("", 3), (other, 3)]
    assert moved[0].message.output_token_ids == (5, 6, 7)
    assert isinstance(aborted[0].message, FinishRequest) and aborted[0].message.reason == FinishReason.ABORT
    # The old replica's late events past the hand-over, and its abort, are not the stream's.
    late = GeneratedTokens(request_id="r", index=3, token_ids=(99,))
    abort = GeneratedTokens(request_id="r", index=4, token_ids=(), finish_reason=FinishReason.ABORT)
    assert tok.on_generated(GeneratedBatch(events=(late,), replica=first)) == []
    assert tok.on_generated(msgspec.structs.replace(abort, replica=first)) == []
    (event,) = tok.on_generated(
        GeneratedBatch(events=(GeneratedTokens(request_id="r", index=3, token_ids=(8,)),), replica=other)
    )
    assert (event.message.index, event.message.token_ids) == (3, (8,))


def test_a_request_waits_for_a_replica_and_ends_with_an_error_if_none_comes(frontend):
    clock = Clock()
    tok = _tokenizer(frontend, clock, replica_wait_s=10)
    clock.now += 6  # both silent
    assert tok.on_request(_request("w")) == []
    clock.now += 5
    assert tok.after_batch() == []
    clock.now += 6
    (error,) = [o for o in tok.after_batch() if o.topic == topics.TOKENS]
    assert error.message.finish_reason == "error" and "no engine replica" in error.message.error
    # An abort of a waiting request is answered here.
    assert tok.on_request(_request("x")) == []
    out = tok.on_request(AbortRequest(request_id="x"))
    assert [o.message.finish_reason for o in out if o.topic == topics.TOKENS] == ["abort"]


def test_a_restarted_tokenizer_sends_each_stream_where_its_journal_says(frontend):
    clock = Clock()
    first = _tokenizer(frontend, clock)
    source = (topics.topic_name(topics.REQUESTS), 0, 3)
    journal, _ = first.on_request(_request(), (), source)
    replica = journal.message.replica
    # The successor reads: the request, its events, the journal, then its own announcement.
    second = _tokenizer(frontend, clock)
    second.announcement()
    assert second.on_request(_request(), (), source) == []
    events = GeneratedBatch(
        events=(GeneratedTokens(request_id="r", index=0, token_ids=(5, 6)),), replica=replica
    )
    assert second.on_generated(events, 10) == []  # deferred until the journal is read
    assert second.on_request(journal.message) == []
    out = second.on_request(TokenizerAnnouncement(tokenizer_id=second.tokenizer_id))
    resent = [o for o in out if o.topic.endswith("tokenized")]
    assert [o.topic for o in resent] == [topics.replica_topic(topics.TOKENIZED, replica)]
    assert [o.message.index for o in out if o.topic == topics.TOKENS] == [0]
    assert not [o for o in out if isinstance(o.message, RequestRouted)]  # not routed again


def test_after_its_start_a_tokenizer_waits_for_the_replicas_statuses_before_routing(frontend):
    clock = Clock()
    tok = TokenizerHandler(frontend, router=Router(clock=clock, wall_clock=clock), clock=clock)
    tok.announcement()
    tok.on_request(TokenizerAnnouncement(tokenizer_id=tok.tokenizer_id))
    assert tok.on_request(_request("early")) == []  # no status read yet: it waits
    clock.now += 1
    tok.on_replica(status("b", clock), 0)
    (journal, sent) = tok.after_batch()
    assert journal.message.replica == "b" and sent.topic == topics.replica_topic(topics.TOKENIZED, "b")
    blind = TokenizerHandler(frontend, router=Router(clock=clock, wall_clock=clock), clock=clock)
    blind.announcement()
    blind.on_request(TokenizerAnnouncement(tokenizer_id=blind.tokenizer_id))
    assert blind.on_request(_request("x")) == []
    clock.now += 3  # still nobody: replica 0, whose scheduler holds it until an executor comes
    (journal, sent) = blind.after_batch()
    assert journal.message.replica == "0" and sent.topic == topics.TOKENIZED


def test_two_tokenizers_share_the_requests_by_id_each_answering_for_its_own(frontend):
    from parkade.services.bus.base import Record
    from parkade.services.tokenizer.handler import shard_of

    clock = Clock()
    tokenizers = [
        TokenizerHandler(
            frontend, router=Router(clock=clock, wall_clock=clock), clock=clock, shard=i, shards=2
        )
        for i in (0, 1)
    ]
    assert [t.group_id for t in tokenizers] == ["parkade-tokenizer", "parkade-tokenizer.1"]
    assert [t.instance_name for t in tokenizers] == [None, "tokenizer.1"]
    ids = [f"req-{i}" for i in range(12)]
    assert {shard_of(i, 2) for i in ids} == {0, 1}
    for rid in ids:
        answers = [t.on_request(_request(rid)) for t in tokenizers]
        assert [bool(a) for a in answers] == [shard_of(rid, 2) == 0, shard_of(rid, 2) == 1], rid
    # Samples go with their request; their events too; another's events are no orphans.
    params = SamplingParams(n=2, max_tokens=5)
    sampled = GenerateRequest(request_id="s", prompt="Once", sampling_params=params)
    owner = tokenizers[shard_of("s", 2)]
    other = tokenizers[1 - shard_of("s", 2)]
    assert {o.message.request_id for o in routed(owner.on_request(sampled))} == {"s#0", "s#1"}
    assert other.on_request(sampled) == []
    event = GeneratedBatch(events=(GeneratedTokens(request_id="s#1", index=0, token_ids=(5,)),))
    assert [o.topic for o in owner.on_generated(event)] == [topics.TOKENS]
    assert other.on_generated(event) == [] and not other.orphans
    # An undecodable request record is answered once, by the tokenizer of its key.
    bad = Record(topics.topic_name(topics.REQUESTS), b"\xc1", key=b"s2", offset=9)
    outs = [t.on_bad_record(bad, ValueError("bad")) for t in tokenizers]
    assert sorted(len(o) for o in outs) == [0, 2]  # a dead letter and an error event, once
    with pytest.raises(ValueError, match="shard"):
        TokenizerHandler(frontend, shard=2, shards=2)


def routed(out):
    return [o for o in out if not isinstance(o.message, RequestRouted)]


def test_a_scheduler_stopped_cleanly_says_its_replica_drains_and_the_tokenizer_hands_over(frontend):
    import asyncio

    from parkade.services.bus.memory import MemoryBus
    from parkade.services.scheduler.main import SchedulerService

    async def stopped() -> list:
        bus = MemoryBus()
        await bus.create_topics(topics.all_topic_names("t."))
        service = SchedulerService(SchedulingOptions(), replica="a")
        await service.start(bus, "t.")
        await service.stop()
        decoder = topics.TopicDecoder(topics.KV_EVENTS)
        return [decoder.decode(r.value) for r in bus.topics["t.kv-events"]]

    (last,) = [m for m in asyncio.run(stopped()) if isinstance(m, ReplicaStatus)]
    assert last.replica == "a" and last.draining
    clock = Clock()
    tok = _tokenizer(frontend, clock)
    journal, _ = tok.on_request(_request())
    name = journal.message.replica
    tok.on_replica(status(name, clock, draining=True))
    out = tok.after_batch()  # at once, not after the timeout
    (pending, moved) = [o.message for o in out if isinstance(o.message, RequestRouted)]
    assert pending.replica == "" and moved.replica not in ("", name)


def test_the_tokenizers_metrics_show_every_replica_and_where_requests_went(frontend):
    clock = Clock()
    tok = _tokenizer(frontend, clock)
    metrics = tok.enable_metrics()
    journal, _ = tok.on_request(_request())
    text = metrics.text().decode()
    name = journal.message.replica
    assert f'parkade:routed_requests_total{{replica="{name}"}} 1.0' in text
    for replica in ("a", "b"):
        assert f'parkade:replica_up{{replica="{replica}"}} 1.0' in text
        assert f'parkade:replica_serving{{replica="{replica}"}} 1.0' in text
    assert f'parkade:replica_open_streams{{replica="{name}"}} 1.0' in text
    assert "parkade:replica_predicted_hit_blocks_total" in text and "parkade:handovers_total 0.0" in text


def test_the_gateway_shows_every_replica_in_health_and_metrics():
    import time

    from parkade.services.gateway.main import Health, _replica_health, _ReplicaGauges
    from parkade.services.gateway.metrics import GatewayMetrics

    health = Health(client=None)
    clock = Clock()
    fresh = status(
        "0", clock, num_running=3, num_blocks=10, num_free_blocks=5, prefix_queries=4, prefix_hits=1
    )
    health.replicas = {"0": (fresh, time.monotonic()), "1": (status("1", clock), time.monotonic() - 60)}
    assert _replica_health(fresh, 0.5)["kv_cache_usage"] == 0.5
    metrics = GatewayMetrics()
    metrics.register(_ReplicaGauges(health))
    text = metrics.text().decode()
    assert 'parkade:replica_serving{replica="0"} 1.0' in text
    assert 'parkade:replica_serving{replica="1"} 0.0' in text  # its status is a minute old
    assert 'parkade:replica_requests_running{replica="0"} 3.0' in text
    assert 'parkade:replica_prefix_hit_rate{replica="0"} 0.25' in text


def test_with_no_other_replica_a_gone_ones_streams_wait_for_it_to_come_back(frontend):
    clock = Clock()
    r = Router("kv", clock=clock, wall_clock=clock, seed=1, replica_timeout_s=5)
    tok = TokenizerHandler(frontend, router=r, clock=clock)
    tok.on_replica(status("a", clock), 0)
    (journal, _) = tok.on_request(_request())
    assert journal.message.replica == "a"
    tok.on_generated(
        GeneratedBatch(events=(GeneratedTokens(request_id="r", index=0, token_ids=(5,)),), replica="a")
    )
    clock.now += 30  # a is silent: restarting, and nobody else could take its streams
    assert tok.after_batch() == []
    tok.on_replica(status("a", clock, pool="a.2"), 1)  # back, it resumes them from its log
    (event,) = tok.on_generated(
        GeneratedBatch(events=(GeneratedTokens(request_id="r", index=1, token_ids=(6,)),), replica="a")
    )
    assert (event.message.index, event.message.token_ids) == (1, (6,))


def test_a_later_route_overrides_the_earlier_ones_from_its_start():
    from parkade.services.tokenizer.routes import PENDING, Route

    route = Route("r", [("a", 0), ("b", 7)])
    assert [route.owner(i) for i in (0, 6, 7, 9)] == ["a", "a", "b", "b"]
    route = Route("r", [("a", 0), (PENDING, 7)])
    assert [route.owner(i) for i in (6, 7)] == ["a", PENDING]
    # Routed again from fewer tokens than it was handed over with (some were not read again).
    route = Route("r", [("a", 0), (PENDING, 7), ("b", 5)])
    assert [route.owner(i) for i in (4, 5, 7, 9)] == ["a", "b", "b", "b"]
