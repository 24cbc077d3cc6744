"""`parkade replica`: one command line builds a replica's scheduler and executor, which keep only
their step topics in memory."""

from __future__ import annotations

from parkade import replica
from parkade.schemas import topics
from parkade.services.bus.serve import BUSY_FETCH_WAIT_MS, STREAM_FETCH_WAIT_MS

SIMULATE = "h200:llama-3-8b"  # no torch, no model folder


def test_one_command_line_builds_both_services_of_the_replica():
    argv = ["--replica", "3", "--simulate", SIMULATE, "--max-num-seqs", "8", "--max-in-flight", "2"]
    services = replica.build_services(replica.parser().parse_args(argv))
    assert list(services) == ["scheduler", "executor"]
    scheduler, executor = services["scheduler"], services["executor"]
    assert scheduler.instance_name == "scheduler.replica-3" and executor.instance_name == "executor.replica-3"
    assert scheduler.options.max_num_seqs == 8 and scheduler.link.max_in_flight == 2
    # The step topics are the replica's own, and the only ones kept in memory.
    plans, results = "replica-3.step-plans", "replica-3.step-results"
    assert executor.consumes == (plans,) and results in scheduler.consumes
    assert replica.local_topics("3") == (plans, results)
    assert replica.local_topics("0") == (topics.STEP_PLANS, topics.STEP_RESULTS)
    assert topics.replica_topic(topics.TOKENIZED, "3") in scheduler.consumes  # on the broker
    # A result comes from memory: the broker's wait paces only new requests (see REQUESTS_FETCH_WAIT_MS).
    assert scheduler.busy_fetch_wait_ms == STREAM_FETCH_WAIT_MS > BUSY_FETCH_WAIT_MS
    assert executor.busy_fetch_wait_ms == BUSY_FETCH_WAIT_MS
