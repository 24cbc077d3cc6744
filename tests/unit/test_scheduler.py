import pytest
from fakes import FakeExecutor

from parkade.schemas import EngineRequest, FinishReason, SamplingParams, StepResult
from parkade.services.scheduler.config import SchedulerConfig
from parkade.services.scheduler.scheduler import Scheduler

BS = 4


def req(request_id, n_prompt, max_tokens=4, first=0, priority=0, arrival=0.0, **params):
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=tuple(range(first, first + n_prompt)),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=(2,),
        priority=priority,
        arrival_time=arrival,
    )


def sched(**overrides) -> Scheduler:
    config = dict(num_blocks=16, block_size=BS, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def sample(plan, tokens: dict[str, int]) -> StepResult:
    ids = tuple(tokens)
    return StepResult(step_id=plan.step_id, request_ids=ids, sampled_token_ids=tuple(tokens[i] for i in ids))


def test_prefill_then_decode_with_exact_blocks():
    s = sched()
    s.add(req("a", 6))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 6}
    (new,) = plan.new_requests
    assert new.block_ids == (0, 1) and new.num_computed_tokens == 0 and new.token_ids == tuple(range(6))
    s.update(plan, sample(plan, {"a": 10}))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests == ()  # no new block: nothing the executor does not know
    s.update(plan, sample(plan, {"a": 11}))
    plan = s.schedule()
    assert plan.cached_requests == ()  # position 7 is the last slot of block 1
    s.update(plan, sample(plan, {"a": 12}))
    plan = s.schedule()
    (cached,) = plan.cached_requests
    assert cached.new_block_ids == (2,) and cached.num_computed_tokens == 8  # position 8: a third block
    s.check_integrity()


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    s = sched(max_num_batched_tokens=8)
    s.add(req("a", 20))
    chunks = []
    for _ in range(3):
        plan = s.schedule()
        chunks.append(plan.num_scheduled_tokens["a"])
        sampled = {"a": 5} if s.requests["a"].num_computed_tokens == 20 else {}
        s.update(plan, sample(plan, sampled))
    assert chunks == [8, 8, 4]
    assert s.requests["a"].output_token_ids == [5]


def test_running_requests_are_scheduled_before_admissions():
    s = sched(max_num_batched_tokens=10)
    s.add(req("a", 9))
    plan = s.schedule()
    s.update(plan, sample(plan, {"a": 7}))
    s.add(req("b", 12, first=100))
    plan = s.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 9}  # b's prompt is chunked into the rest


def test_max_num_seqs_caps_the_batch():
    s = sched(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 2, first=10 * i))
    plan = s.schedule()
    assert set(plan.num_scheduled_tokens) == {"r0", "r1"}


def test_preemption_recomputes_the_newest_request_and_it_resumes_from_cache():
    s = sched(num_blocks=4, max_num_batched_tokens=64)
    s.add(req("a", 8, max_tokens=20))
    s.add(req("b", 8, max_tokens=20, first=100))
    plan = s.schedule()
    assert [n.block_ids for n in plan.new_requests] == [(0, 1), (2, 3)]
    s.update(plan, sample(plan, {"a": 1, "b": 1}))  # each holds 8 computed tokens in 2 blocks
    plan = s.schedule()  # a's 9th token needs a block: b is preempted
    assert plan.num_scheduled_tokens == {"a": 1}
    assert plan.cached_requests[0].new_block_ids == (3,)  # b's freed tail block
    assert plan.preempted_request_ids == ("b",)
    assert s.requests["b"].num_computed_tokens == 0 and s.num_preemptions == 1
    s.check_integrity()
    s.finish_request("a")
    plan = s.schedule()
    (resumed,) = plan.new_requests
    assert resumed.request_id == "b"
    assert resumed.token_ids == (*range(100, 108), 1)
    assert resumed.num_computed_tokens == 4  # its first block survived as a cache hit
    assert plan.finished_request_ids == ("a",)
    s.check_integrity()


def test_priority_policy_admits_and_preempts_by_priority():
    s = sched(num_blocks=4, scheduling_policy="priority", max_num_batched_tokens=64)
    s.add(req("low", 8, max_tokens=20, priority=5, arrival=0.0))
    s.add(req("high", 8, max_tokens=20, priority=0, arrival=1.0, first=100))
    plan = s.schedule()
    assert [n.request_id for n in plan.new_requests] == ["high", "low"]
    s.update(plan, sample(plan, {"high": 1, "low": 1}))
    plan = s.schedule()
    assert plan.preempted_request_ids == ("low",) and plan.num_scheduled_tokens == {"high": 1}


def test_priority_preemption_of_an_already_scheduled_request_returns_its_budget():
    s = sched(num_blocks=4, scheduling_policy="priority", max_num_batched_tokens=64)
    s.add(req("low", 6, max_tokens=20, priority=5))
    plan = s.schedule()
    s.add(req("high", 8, max_tokens=20, priority=0, first=100))
    s.update(plan, sample(plan, {"low": 1}))
    plan = s.schedule()  # low decodes; high is admitted with the last 2 blocks
    assert plan.num_scheduled_tokens == {"low": 1, "high": 8}
    s.update(plan, sample(plan, {"low": 1, "high": 1}))
    plan = s.schedule()  # low fits and is scheduled; then high needs a block and low is the victim
    assert plan.preempted_request_ids == ("low",)
    assert plan.num_scheduled_tokens == {"high": 1}
    assert [c.request_id for c in plan.cached_requests] == ["high"]
    s.check_integrity()


def test_stop_conditions():
    s = sched()
    s.add(req("eos", 3, max_tokens=10))
    s.add(req("stop_id", 3, max_tokens=10, stop_token_ids=(9,), first=10))
    s.add(req("length", 3, max_tokens=1, first=20))
    s.add(req("ignore", 3, max_tokens=10, ignore_eos=True, first=30))
    s.add(req("min", 3, max_tokens=10, min_tokens=2, first=40))
    plan = s.schedule()
    out = {
        o.request_id: o
        for o in s.update(
            plan,
            sample(
                plan,
                {
                    "eos": 2,
                    "stop_id": 9,
                    "length": 5,
                    "ignore": 2,
                    "min": 2,
                },
            ),
        )
    }
    assert (out["eos"].finish_reason, out["eos"].stop_reason) == (FinishReason.STOP, None)
    assert (out["stop_id"].finish_reason, out["stop_id"].stop_reason) == (FinishReason.STOP, 9)
    assert out["length"].finish_reason == FinishReason.LENGTH
    assert out["ignore"].finish_reason is None
    assert out["min"].finish_reason is None  # EOS before min_tokens does not stop
    assert set(s.requests) == {"ignore", "min"}
    plan = s.schedule()
    assert set(plan.finished_request_ids) == {"eos", "stop_id", "length"}
    s.check_integrity()


def test_max_model_len_finishes_with_length():
    s = sched(max_model_len=8)
    s.add(req("a", 7, max_tokens=None))
    plan = s.schedule()
    (out,) = s.update(plan, sample(plan, {"a": 3}))
    assert out.finish_reason == FinishReason.LENGTH


def test_prompts_that_can_never_run_fail_at_once():
    s = sched(num_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        s.add(req("long", 65))
    with pytest.raises(ValueError, match="KV pool holds"):
        s.add(req("big", 9))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_model_len \(64\)"):
        sched(enable_chunked_prefill=False, max_num_batched_tokens=8)
    s.add(req("ok", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("ok", 3))


def test_a_result_for_a_finished_request_never_reaches_a_new_one_with_its_id():
    s = sched()
    s.add(req("x", 3, max_tokens=8))
    first = s.schedule()
    assert s.update(first, sample(first, {"x": 7}))[0].token_ids == (7,)
    in_flight = s.schedule()  # x's decode: its result comes back after x is gone
    s.finish_request("x")
    s.add(req("x", 3, max_tokens=8, first=40))  # the id reused
    readmitted = s.schedule()
    assert s.update(in_flight, sample(in_flight, {"x": 99})) == []  # sampled for the old x
    (event,) = s.update(readmitted, sample(readmitted, {"x": 5}))
    assert event.index == 0 and event.token_ids == (5,)
    assert s.requests["x"].output_token_ids == [5] and s.requests["x"].num_output_placeholders == 0
    s.check_integrity()


def test_abort_frees_blocks_and_is_idempotent():
    s = sched()
    s.add(req("a", 6))
    s.add(req("w", 6, first=50))
    plan = s.schedule()
    event = s.finish_request("a")
    assert event is not None and event.finish_reason == FinishReason.ABORT
    assert s.finish_request("a") is None
    s.finish_request("w")  # running too
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()
    # a result for an aborted request is dropped
    assert s.update(plan, sample(plan, {"a": 1})) == []
    s.check_integrity()


def test_reserve_admission_holds_blocks_for_max_tokens():
    s = sched(admission="reserve", num_blocks=6)
    s.add(req("a", 4, max_tokens=8))  # 12 tokens -> 3 blocks up front
    s.add(req("b", 4, max_tokens=8, first=50))
    s.add(req("c", 4, max_tokens=8, first=90))
    plan = s.schedule()
    assert [n.block_ids for n in plan.new_requests] == [(0, 1, 2), (3, 4, 5)]  # c waits
    paged = sched(num_blocks=6)
    for r in ("a", "b", "c"):
        paged.add(req(r, 4, max_tokens=8, first=ord(r)))
    assert len(paged.schedule().new_requests) == 3


def test_fake_executor_agrees_with_plans_through_a_whole_run():
    s = sched(num_blocks=6, max_num_batched_tokens=10)
    ex = FakeExecutor(vocab_size=3, block_size=BS, seed=1)  # EOS (2) is common
    for i in range(6):
        s.add(req(f"r{i}", 3 + 2 * i, max_tokens=6, first=7 * i))
    steps = 0
    while s.has_unfinished_requests():
        plan = s.schedule()
        s.update(plan, ex.execute(plan))
        s.check_integrity()
        steps += 1
        assert steps < 200
    assert s.kv.num_free_blocks == 6


def test_a_request_preempted_before_its_step_leaves_no_uncomputed_block_in_the_cache():
    """Under the priority policy the victim can be a request already scheduled in this step.
    Its blocks for this step were never computed, so none of them may serve a later prefix hit.
    (Found by review; the fake executor checks every KV slot a request reads.)"""
    s = sched(num_blocks=25, block_size=2, max_num_seqs=5, max_num_batched_tokens=28, max_model_len=48)
    s = Scheduler(SchedulerConfig(**{**s.config.__dict__, "scheduling_policy": "priority"}))
    ex = FakeExecutor(vocab_size=1, block_size=2)  # every sampled token is 0: prefixes repeat
    shapes = [(1, 1, 0)] * 4 + [(11, 5, 1), (17, 3, 3), (1, 1, 0), (1, 1, 0), (1, 2, 0), (1, 4, 0)]
    pending = [
        (
            2 if i == 5 else 0,
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple([1, 2, 3, 4] * g + [0] * n),
                sampling_params=SamplingParams(max_tokens=m, ignore_eos=True),
                arrival_time=float(i),
            ),
        )
        for i, (n, m, g) in enumerate(shapes)
    ]
    late = EngineRequest(
        request_id="late",
        prompt_token_ids=(0,) * 7,
        sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
        arrival_time=99.0,
    )
    pending.append((6, late))
    step = 0
    while pending or s.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            s.add(item[1])
            pending.remove(item)
        plan = s.schedule()
        s.update(plan, ex.execute(plan))  # the fake asserts that every KV read is what was written
        s.check_integrity()
        step += 1
    assert s.num_preemptions >= 1


def test_steps_in_flight_decode_ahead_and_stale_results_after_preemption_are_dropped():
    s = sched(num_blocks=4)
    s.add(req("a", 4, max_tokens=10))
    s.add(req("b", 8, max_tokens=10, first=100))
    plan1 = s.schedule()  # both prefill and will sample; their results are not back yet
    assert s.requests["a"].num_output_placeholders == 1
    plan2 = s.schedule()  # a decodes its unknown token 4 ahead; b needs a block: preempted
    assert plan2.num_scheduled_tokens == {"a": 1} and plan2.preempted_request_ids == ("b",)
    plan3 = s.schedule()  # b is admitted again (its first block is still cached)
    assert [n.request_id for n in plan3.new_requests] == ["b"]
    assert plan3.new_requests[0].token_ids == tuple(range(100, 108))
    events = s.update(plan1, sample(plan1, {"a": 7, "b": 9}))
    assert [(e.request_id, e.token_ids) for e in events] == [("a", (7,))]  # b's token is stale
    assert s.requests["b"].num_output_tokens == 0 and s.requests["b"].num_output_placeholders == 1
    s.update(plan2, sample(plan2, {"a": 8}))
    s.update(plan3, sample(plan3, {"a": 5, "b": 6}))
    assert s.requests["a"].output_token_ids == [7, 8, 5]
    assert s.requests["b"].output_token_ids == [6]
    s.check_integrity()


def test_no_decode_is_scheduled_past_max_tokens_while_steps_are_in_flight():
    s = sched()
    s.add(req("a", 3, max_tokens=2))
    plan1 = s.schedule()
    plan2 = s.schedule()  # decodes token 1, the last one
    assert plan2.num_scheduled_tokens == {"a": 1}
    assert s.schedule().num_scheduled_tokens == {}  # both outputs are already in flight
    s.update(plan1, sample(plan1, {"a": 4}))
    (event,) = s.update(plan2, sample(plan2, {"a": 5}))
    assert event.finish_reason == FinishReason.LENGTH


def test_a_full_waiting_queue_refuses_new_requests_at_once():
    from parkade.services.scheduler.scheduler import OverloadedError

    s = sched(max_waiting_requests=3, max_waiting_tokens=20, max_model_len=64, num_blocks=64)
    s.add(req("huge", 30))  # over the token bound, but the queue was empty: it waits
    with pytest.raises(OverloadedError, match=r"overloaded: 1 requests \(30 tokens\) waiting"):
        s.add(req("next", 2))
    s.schedule()  # "huge" runs: the queue is empty again
    for i in range(3):
        s.add(req(f"w{i}", 5))
    with pytest.raises(OverloadedError, match="max_waiting_requests=3"):
        s.add(req("fourth", 1))
    s.finish_request("w0")
    s.add(req("fourth", 1))
    s.check_integrity()  # the queue's token count follows adds, removals and admissions
    assert s.waiting.num_tokens == 11


# ---- what the scheduler service asks of the core after a failed step or a new executor -------


def test_recompute_all_queues_every_running_request_again_on_an_empty_prefix_cache():
    s = sched()
    for request_id, first in (("a", 0), ("b", 40)):
        s.add(req(request_id, 8, first=first))
    plan = s.schedule()
    s.update(plan, sample(plan, {"a": 20, "b": 21}))
    kv = s.kv
    assert kv.pool.num_cached_blocks == 4 and not s.reset_prefix_cache()  # in use: refused
    s.recompute_all()
    assert s.kv is kv and kv.num_prefix_queries == 16  # the same manager: its counters go on
    assert not s.running and [r.request_id for r in s.waiting] == ["a", "b"]
    assert kv.pool.num_cached_blocks == 0 and kv.num_free_blocks == 16
    plan = s.schedule()
    # Recomputed from prompt + outputs with no prefix hit; the executor, which dropped its state,
    # hears of no finished or preempted request.
    assert [(n.request_id, n.num_computed_tokens, n.token_ids[-1]) for n in plan.new_requests] == [
        ("a", 0, 20),
        ("b", 0, 21),
    ]
    assert plan.finished_request_ids == () and plan.preempted_request_ids == ()
    s.check_integrity()


def test_a_request_to_isolate_gets_a_step_of_its_own_ahead_of_the_queue():
    s = sched()
    for request_id, first in (("a", 0), ("b", 10), ("c", 20)):
        s.add(req(request_id, 6, first=first))
    plan = s.schedule(isolate={"b", "x"})  # the first of them waiting: b, though a is at the head
    assert plan.num_scheduled_tokens == {"b": 6}
    plan = s.schedule(isolate={"b"})  # b runs now: nothing to isolate, the usual step
    assert set(plan.num_scheduled_tokens) == {"a", "b", "c"}
    s.check_integrity()


def test_a_request_to_isolate_that_does_not_fit_lets_the_usual_step_run():
    s = sched(num_blocks=4)
    s.add(req("a", 12, max_tokens=2))  # three of the four blocks
    s.schedule()
    s.add(req("big", 8, first=30))  # two blocks: no room while a runs
    plan = s.schedule(isolate={"big"})
    assert plan.num_scheduled_tokens == {"a": 1}
    s.check_integrity()


def test_a_request_to_isolate_never_joins_a_step_with_others():
    """Short of room for its step of its own, the usual step runs, and it stays out of it even
    where a chunk of it would fit: if it breaks steps, it must break one alone."""
    s = sched(num_blocks=16, max_num_batched_tokens=32, max_num_seqs=16)
    for i in range(9):
        s.add(req(f"r{i}", 3, max_tokens=2, first=4 * i))  # a block each, decodes included
    s.schedule()
    s.add(req("p", 40, first=100))  # ten blocks alone: 7 are free
    plan = s.schedule(isolate={"p"})
    # 23 tokens of budget and 7 blocks are left: a chunk of p would fit, and does not join.
    assert plan.num_scheduled_tokens == {f"r{i}": 1 for i in range(9)}
    s.add(req("q", 4, first=200))  # behind p: nobody overtakes the head of the queue
    assert "q" not in s.schedule(isolate={"p"}).num_scheduled_tokens
    s.check_integrity()
