"""The in-process engine and the services behave alike where the front end and the scheduler's
configuration decide: priority ties go by arrival on both paths, and both refuse the same
settings with the same words."""

from __future__ import annotations

import asyncio

import pytest
from hf_reference import STORIES
from pipeline import running_pipeline

from parkade import LLM, AsyncLLM, SamplingParams
from parkade.client import Client
from parkade.services.bus import MemoryBus
from parkade.services.executor.executor import CPU_MAX_NUM_BATCHED_TOKENS, CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS
from parkade.services.scheduler.config import SchedulingOptions

# Requests of equal priority arriving in this order: by arrival they run c, b, a; were
# arrival_time lost (all 0.0), the tie-break on request id would run them a, b, c.
ARRIVALS = ["c", "b", "a"]
SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def test_priority_ties_run_in_arrival_order_in_process():
    llm = LLM(STORIES, max_model_len=128, scheduling_policy="priority", max_num_seqs=1)
    for request_id in ARRIVALS:
        llm.engine.add_request(request_id, "Once upon a time", SHORT)
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += [o.request_id for o in llm.engine.step() if o.finished]
    assert finished == ARRIVALS


def test_priority_ties_run_in_arrival_order_through_the_services():
    options = SchedulingOptions(scheduling_policy="priority", max_num_seqs=1)

    async def main() -> list[str]:
        bus = MemoryBus()
        async with (
            running_pipeline(bus, STORIES, prefix="t.", options=options, max_model_len=128),
            Client(bus=bus, topic_prefix="t.") as client,
        ):
            # A long request holds the one running slot while the others arrive and wait.
            blocker = await client.submit(
                prompt="Lily", sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            )
            blocker_stream = client.stream(blocker)
            await anext(blocker_stream)  # admitted and running
            for request_id in ARRIVALS:
                await client.submit(prompt="Once upon a time", sampling_params=SHORT, request_id=request_id)
            order: list[str] = []

            async def finish(request_id: str) -> None:
                async for event in client.stream(request_id):
                    if event.finish_reason is not None:
                        order.append(request_id)

            await asyncio.gather(*(finish(r) for r in ARRIVALS), _drain(blocker_stream))
            return order

    assert asyncio.run(main()) == ARRIVALS


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_both_paths_refuse_a_budget_below_max_model_len_without_chunked_prefill():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_model_len \(64\)"):
        LLM(STORIES, max_model_len=64, enable_chunked_prefill=False, max_num_batched_tokens=32)
    unset = LLM(STORIES, max_model_len=64, enable_chunked_prefill=False)
    # Unset, the budget is vLLM-CPU's by usage: twice the server's for LLM's offline batches.
    assert unset.engine.core.scheduler.config.max_num_batched_tokens == CPU_OFFLINE_MAX_NUM_BATCHED_TOKENS
    serving = AsyncLLM(STORIES, max_model_len=64, enable_chunked_prefill=False)
    assert serving.engine.core.scheduler.config.max_num_batched_tokens == CPU_MAX_NUM_BATCHED_TOKENS
    # The service's side of the same rule: tests/unit/test_service_handlers.py.
