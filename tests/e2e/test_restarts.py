"""Services killed with SIGKILL mid-generation under `parkade up` (which restarts them): every
stream completes with the in-process engine's tokens and text, each index once and in order.

One stack of single services, one round per fault: the scheduler, the tokenizer, the executor,
the scheduler twice in a row, the scheduler and the tokenizer at once. And `parkade up`'s own
layout (the tokenizer in the gateway's process, a replica in one): the gateway, then the gateway
and the replica at once. Each round runs 8 concurrent streams of a Kafka client (half greedy,
half seeded sampling) and kills once every stream has 30 tokens.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from stack import START_TIMEOUT_S, Up

from parkade import LLM, SamplingParams
from parkade.client import Client

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Once upon a time",
    "Lily and Tom",
    "The big dog",
    "One day, a girl",
    "Tim had a red ball",
    "The sun was hot",
    "Sue liked to sing",
    "A little bird",
]
MAX_TOKENS = 200
KILL_AT = 30  # tokens every stream has when the kill comes
ROUNDS = [["scheduler"], ["tokenizer"], ["executor"], ["scheduler", "scheduler"], ["scheduler", "tokenizer"]]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


async def _wait_for_new_pid(up: Up, name: str, old: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while up.wait_ready()["pids"][name] == old:
        assert up.proc.poll() is None, f"parkade up stopped:\n{up.output()}"
        assert time.monotonic() < deadline, f"{name} not restarted:\n{up.output()}"
        await asyncio.sleep(0.1)


async def _round(up: Up, client: Client, kills: list[str]) -> list[list]:
    events: list[list] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        async for event in client.generate(prompt=PROMPTS[i], sampling_params=_params(i), timeout_s=240):
            events[i].append(event)

    async def until_tokens(n: int) -> None:
        while min(sum(len(e.token_ids) for e in es) for es in events) < n:
            await asyncio.sleep(0.005)

    streams = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    try:
        await until_tokens(KILL_AT)
        if kills == ["scheduler", "scheduler"]:  # twice in a row: again once it is back and serving
            old = up.wait_ready()["pids"]["scheduler"]
            os.kill(old, signal.SIGKILL)
            await _wait_for_new_pid(up, "scheduler", old)
            await until_tokens(KILL_AT + 20)
            kills = ["scheduler"]
        pids = up.wait_ready()["pids"]
        for name in kills:
            os.kill(pids[name], signal.SIGKILL)
        await asyncio.wait_for(streams, 300)
    finally:
        streams.cancel()
    return events


def _expected() -> list:
    llm = LLM(dtype="float32")
    return [o.outputs[0] for o in llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])]


def _check_rounds(up: Up, rounds: list[list[str]], restarts: dict[str, int]) -> None:
    """Each round's streams end as the in-process engine's; `restarts`: each child's count."""
    expected = _expected()
    try:
        state = up.wait_ready()

        async def main():
            async with Client(state["bootstrap_servers"]) as client:
                for kills in rounds:
                    events = await _round(up, client, kills)
                    for i, (got, want) in enumerate(zip(events, expected, strict=True)):
                        where = f"round {kills}, stream {i}"
                        indices = [e.index for e in got if e.token_ids]
                        assert indices == sorted(set(indices)), where  # each index once, in order
                        tokens = [t for e in got for t in e.token_ids]
                        assert tokens == want.token_ids, where  # gapless and the same tokens
                        assert "".join(e.text for e in got) == want.text, where
                        last = got[-1]
                        assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS

        asyncio.run(main())
        log = up.log_path.read_text()
        for name, times in restarts.items():
            assert log.count(f"restarting the {name}") == times, log
    except AssertionError:
        print(up.output())
        raise
    finally:
        code = up.stop()
    assert code == 0, up.output()


def test_killed_services_resume_every_stream_exactly(tmp_path):
    # Each service on its own.
    up = Up(tmp_path / "home", "--dtype", "float32", "--split-replicas", "--split-tokenizer")
    _check_rounds(up, ROUNDS, {"scheduler": 4, "tokenizer": 2, "executor": 1})


def test_a_killed_gateway_with_its_tokenizer_resumes_every_stream_exactly(tmp_path):
    """The tokenizer in the gateway's process: killed with it, it resumes from its commits."""
    up = Up(tmp_path / "home", "--dtype", "float32")
    _check_rounds(up, [["gateway"], ["gateway", "replica"]], {"gateway": 2, "replica": 1})
