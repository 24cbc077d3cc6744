"""The simulated executor through Kafka: the same tokens, text and finish reasons as in process,
a length limit from the simulated model (past the model folder's), and exact streams after its
services are killed under `parkade up`; its executor runs without torch."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import pytest
from hf_reference import STORIES
from pipeline import running_pipeline, wait_idle
from stack import TANSU_NOT_LEADER, Up
from test_restarts import _wait_for_new_pid

from parkade import LLM, AsyncLLM, SamplingParams
from parkade.client import Client
from parkade.schemas import topics
from parkade.services.bus.kafka import KafkaBus

pytestmark = [pytest.mark.e2e]

SIMULATE = "h200:llama-3-8b"
# Fast enough for a test, slow enough that steps batch several requests.
ENGINE = dict(simulate=SIMULATE, simulate_speedup=20.0, simulate_eos_probability=0.05, max_model_len=1024)


def _workload() -> dict[str, tuple[object, SamplingParams]]:
    long_prompt = {"prompt_token_ids": [5 + i % 400 for i in range(700)]}  # past stories260K's 512
    return {
        "greedy-0": ("Once upon a time", SamplingParams(temperature=0, max_tokens=40)),
        "greedy-1": ("Lily and Tom", SamplingParams(temperature=0, max_tokens=80, min_tokens=60)),
        "seeded-0": ("The big dog", SamplingParams(temperature=0.8, seed=3, max_tokens=64)),
        "seeded-1": (
            "Tim had a ball",
            SamplingParams(temperature=0.8, seed=4, max_tokens=64, ignore_eos=True),
        ),
        "stop": ("Mom said", SamplingParams(temperature=0, max_tokens=100, stop=["e"])),
        "long": (long_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    }


async def _in_process(workload) -> dict[str, tuple[list[int], str, str]]:
    engine = AsyncLLM(STORIES, **ENGINE)
    out = {}
    try:
        for rid, (prompt, params) in workload.items():
            async for output in engine.generate(prompt, params, request_id=rid):
                final = output.outputs[0]
            out[rid] = (list(final.token_ids), final.text, final.finish_reason)
    finally:
        await engine.shutdown()
    return out


@TANSU_NOT_LEADER
def test_simulated_tokens_are_the_same_in_process_and_through_kafka(bootstrap_servers):
    workload = _workload()
    expected = asyncio.run(_in_process(workload))
    reasons = {reason for _, _, reason in expected.values()}
    assert {"stop", "length"} <= reasons  # EOS and stop strings as well as max_tokens
    assert len(expected["greedy-1"][0]) >= 60  # min_tokens kept to
    assert len(expected["long"][0]) == 30

    async def main():
        prefix = f"t{uuid.uuid4().hex[:8]}."
        bus = KafkaBus(bootstrap_servers, client_id="e2e-simulated")
        await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
        try:
            async with running_pipeline(bus, STORIES, prefix=prefix, **ENGINE) as pipeline:
                async with Client(bootstrap_servers, prefix) as client:

                    async def one(rid: str) -> tuple[list[int], str, str]:
                        prompt, params = workload[rid]
                        fields = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
                        events = [
                            e async for e in client.generate(**fields, sampling_params=params, request_id=rid)
                        ]
                        assert all(e.error is None for e in events), events[-1].error
                        tokens = [t for e in events for t in e.token_ids]
                        return tokens, "".join(e.text for e in events), events[-1].finish_reason

                    got = await asyncio.gather(*(one(rid) for rid in workload))
                await wait_idle(pipeline)
                assert pipeline.scheduler.scheduler.config.max_model_len == 1024  # the simulated model's
                kv = pipeline.scheduler.scheduler.kv
                assert kv.num_free_blocks == kv.num_blocks
                return dict(zip(workload, got, strict=True))
        finally:
            await bus.close()

    assert asyncio.run(asyncio.wait_for(main(), 240)) == expected


PROMPTS = ["Once upon a time", "Lily and Tom", "The big dog", "One day, a girl"]


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=10 + i, max_tokens=150, ignore_eos=True)


@pytest.mark.parametrize(
    "layout, victims",
    [(("--split-replicas",), ("executor", "scheduler")), ((), ("replica",))],
    ids=["split", "one-process"],
)
def test_up_simulate_resumes_every_stream_exactly_after_its_executor_and_scheduler_are_killed(
    tmp_path, layout, victims
):
    """Split, the executor then the scheduler is killed mid-stream; in one process, the replica
    (both at once, and its in-memory step topics with them)."""
    speed = ("--simulate", SIMULATE, "--simulate-speedup", "5")
    llm = LLM(simulate=SIMULATE, simulate_speedup=1e6)
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])]
    up = Up(tmp_path / "home", *speed, *layout)
    try:
        state = up.wait_ready()
        executor_pid = state["pids"][victims[0]]
        with open(f"/proc/{executor_pid}/maps") as maps:
            assert "libtorch" not in maps.read()  # the simulated executor loads no torch

        async def main():
            async with Client(state["bootstrap_servers"]) as client:
                for victim in victims:
                    events: list[list] = [[] for _ in PROMPTS]

                    async def one(i: int, events: list[list] = events) -> None:
                        async for event in client.generate(
                            prompt=PROMPTS[i], sampling_params=_seeded(i), timeout_s=240
                        ):
                            events[i].append(event)

                    streams = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
                    while min(sum(len(e.token_ids) for e in es) for es in events) < 30:
                        await asyncio.sleep(0.005)
                    old = up.wait_ready()["pids"][victim]
                    os.kill(old, signal.SIGKILL)
                    await _wait_for_new_pid(up, victim, old)
                    await asyncio.wait_for(streams, 240)
                    for i, (got, want) in enumerate(zip(events, expected, strict=True)):
                        assert [t for e in got for t in e.token_ids] == want.token_ids, (victim, i)
                        assert "".join(e.text for e in got) == want.text, (victim, i)

        asyncio.run(main())
        assert "simulating llama-3-8b on h200" in up.output()
    except AssertionError:
        print(up.output())
        raise
    finally:
        code = up.stop()
    assert code == 0, up.output()
