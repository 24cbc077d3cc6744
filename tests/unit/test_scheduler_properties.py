"""Random workloads against the scheduler: integrity after every step, nothing leaks."""

from collections import deque

from fakes import FakeExecutor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parkade.schemas import EngineRequest, FinishReason, SamplingParams
from parkade.services.scheduler.config import SchedulerConfig
from parkade.services.scheduler.scheduler import Scheduler

request_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # shared-prefix group (same leading tokens), to exercise cache hits
    st.integers(0, 2),  # priority
)
workload_st = st.fixed_dictionaries(
    {
        "requests": st.lists(request_st, min_size=1, max_size=12),
        "arrivals": st.lists(st.integers(0, 8), min_size=12, max_size=12),
        "aborts": st.sets(st.integers(0, 11), max_size=3),
        "abort_step": st.integers(0, 10),
        "block_size": st.sampled_from([1, 2, 4, 16]),
        "extra_blocks": st.integers(0, 20),
        "budget": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 6),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
        "admission": st.sampled_from(["paged", "reserve"]),
        "caching": st.booleans(),
        "chunked_prefill": st.booleans(),
        "seed": st.integers(0, 1000),
        "vocab": st.sampled_from([1, 3, 30]),  # a tiny vocabulary makes outputs share prefixes
        "in_flight": st.integers(1, 3),  # steps scheduled before the oldest result returns
    }
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(w=workload_st)
def test_random_workloads_keep_integrity_and_free_every_block(w):
    bs = w["block_size"]
    max_len = 64
    # The smallest legal pool holds one max-length request; preemption is then common.
    num_blocks = -(-max_len // bs) + w["extra_blocks"]
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=bs,
            max_num_seqs=w["max_num_seqs"],
            # Without chunked prefill a whole resumed request must fit one step.
            max_num_batched_tokens=w["budget"] if w["chunked_prefill"] else max_len + w["budget"],
            enable_chunked_prefill=w["chunked_prefill"],
            max_model_len=max_len,
            enable_prefix_caching=w["caching"],
            scheduling_policy=w["scheduling_policy"],
            admission=w["admission"],
        )
    )
    ex = FakeExecutor(vocab_size=w["vocab"], seed=w["seed"], block_size=bs)
    pending = [
        (
            w["arrivals"][i],
            i,
            EngineRequest(
                request_id=f"r{i}",
                prompt_token_ids=tuple([7] * 20 * (group > 0) + list(range(100 * i, 100 * i + n)))[
                    : max_len - 1
                ],
                sampling_params=SamplingParams(max_tokens=m),
                eos_token_ids=(0,) if w["vocab"] > 1 else (),
                priority=prio,
                arrival_time=float(i),
            ),
        )
        for i, (n, m, group, prio) in enumerate(w["requests"])
    ]
    s_prompts = {item[2].request_id: item[2].prompt_token_ids for item in pending}
    outputs: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    in_flight: deque = deque()  # (plan, result): the executor runs plans in order, at once
    step = 0
    while pending or s.has_unfinished_requests() or in_flight:
        for item in [p for p in pending if p[0] <= step]:
            s.add(item[2])
            pending.remove(item)
        if step == w["abort_step"]:
            for i in w["aborts"]:
                event = s.finish_request(f"r{i}")
                if event is not None:
                    finished[event.request_id] = event.finish_reason
        plan = s.schedule()
        assert plan.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(plan.num_scheduled_tokens) <= w["max_num_seqs"]
        if plan.num_scheduled_tokens or plan.finished_request_ids or plan.preempted_request_ids:
            in_flight.append((plan, ex.execute(plan)))
        if len(in_flight) >= w["in_flight"] or (in_flight and not plan.num_scheduled_tokens):
            for event in s.update(*in_flight.popleft()):
                got = outputs.setdefault(event.request_id, [])
                assert event.index == len(got), "token indices have gaps or repeats"
                got.extend(event.token_ids)
                if event.finish_reason is not None:
                    finished[event.request_id] = event.finish_reason
        if not in_flight:
            s.check_integrity()
        step += 1
        assert step < 3000, "no progress"
    assert s.kv.num_free_blocks == num_blocks
    assert set(finished) == {f"r{i}" for i in range(len(w["requests"]))}
    for i, (_, m, _, _) in enumerate(w["requests"]):
        rid = f"r{i}"
        got = outputs.get(rid, [])
        num_prompt = len(s_prompts[rid])
        assert len(got) <= m
        # tokens delivered are exactly the executor's, in order
        sampled = ex.sampled.get(rid, {})
        assert got == [sampled[i] for i in range(len(got))]
        if finished[rid] is FinishReason.ABORT:
            continue
        if finished[rid] is FinishReason.LENGTH:
            assert len(got) == m or num_prompt + len(got) >= max_len
        else:
            assert finished[rid] is FinishReason.STOP and got[-1] == 0 and 0 not in got[:-1]
