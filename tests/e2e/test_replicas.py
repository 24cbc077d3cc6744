"""Engine replicas through Kafka with the real model: `parkade up --replicas 2 --tokenizers 2`
spreads the streams over both replicas (and the requests over both tokenizers), and a replica
that is killed (it comes back first) or hangs (its requests are handed over to the other one),
or a tokenizer killed (its successor reads the routing journal), loses nothing: every seeded
stream is exactly what one process makes; a replica started while serving takes requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
from stack import START_TIMEOUT_S, Up
from test_restarts import _wait_for_new_pid

from parkade import LLM, SamplingParams
from parkade.client import Client
from parkade.schemas import RequestRouted, topics
from parkade.services.bus.kafka import KafkaBus

PROMPTS = [f"Once upon a time, {name} went to the" for name in ("Tom", "Lily", "Sam", "Mia", "Ben", "Zoe")]
FAST_HANDOVER = ("--replica-timeout-s", "2")


def _wait_serving(state: dict, replicas: set[str]) -> None:
    """Until the gateway's /health says each of `replicas` serves (an executor joined it)."""
    health = state["gateway_url"].removesuffix("/v1") + "/health"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        listed = httpx.get(health).json().get("replicas", {})
        if all(listed.get(r, {}).get("serving") for r in replicas):
            return
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)


def _seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=160, ignore_eos=True)


async def _routes(bootstrap: str) -> list[RequestRouted]:
    """The tokenizer's routing journal, as far as it is written."""
    bus = KafkaBus(bootstrap, client_id="test-routes")
    name = topics.topic_name(topics.REQUESTS)
    consumer = await bus.consumer([name], None, start={name: 0})
    decoder = topics.TopicDecoder(topics.REQUESTS)
    routes = []
    try:
        for _ in range(10):
            for record in await consumer.getmany(timeout_ms=200):
                message = decoder.decode(record.value, record.header(topics.CONTENT_TYPE))
                if isinstance(message, RequestRouted):
                    routes.append(message)
    finally:
        await consumer.stop()
        await bus.close()
    return routes


async def _round(client: Client, disturb) -> list[list]:
    """Every prompt at once; `disturb()` once each stream has 30 tokens; -> each stream's events."""
    events: list[list] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        async for event in client.generate(prompt=PROMPTS[i], sampling_params=_seeded(i), timeout_s=240):
            events[i].append(event)

    streams = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    while min(sum(len(e.token_ids) for e in es) for es in events) < 30:
        await asyncio.sleep(0.005)
    await disturb()
    await asyncio.wait_for(streams, 240)
    return events


def test_two_replicas_lose_nothing_when_one_is_killed_or_hangs(tmp_path):
    expected = [o.outputs[0] for o in LLM().generate(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])]
    up = Up(tmp_path / "home", "--replicas", "2", "--tokenizers", "2", *FAST_HANDOVER)
    try:
        state = up.wait_ready()
        assert {"scheduler", "scheduler-1", "executor", "executor-1", "tokenizer-1"} <= set(state["pids"])
        _wait_serving(state, {"0", "1"})

        def check(events: list[list], what: str) -> None:
            for i, (got, want) in enumerate(zip(events, expected, strict=True)):
                indices = [e.index for e in got if e.token_ids]
                assert indices == sorted(set(indices)), (what, i, "an index repeated")
                assert [t for e in got for t in e.token_ids] == want.token_ids, (what, i)
                assert "".join(e.text for e in got) == want.text, (what, i)
                assert got[-1].finish_reason == "length", (what, i)

        async def main():
            async with Client(state["bootstrap_servers"]) as client:
                # 1. kill -9 replica 1's scheduler: `parkade up` restarts it, and it resumes its own.
                async def kill() -> None:
                    old = up.wait_ready()["pids"]["scheduler-1"]
                    os.kill(old, signal.SIGKILL)
                    await _wait_for_new_pid(up, "scheduler-1", old)

                check(await _round(client, kill), "killed")
                routes = await _routes(state["bootstrap_servers"])
                assert {r.replica for r in routes if r.replica} == {"0", "1"}, routes  # both took streams

                # 2. a replica's scheduler hangs past the timeout: its streams go on at the other,
                # and once it wakes its copies are aborted (never run twice to completion).
                # NOTE: the replica that took the most of this round's streams: the router may
                # send them all to one (seen in CI: replica 1 had none after round 1's hand-over).
                hung: list[str] = []

                async def hang() -> None:
                    taken = [r.replica for r in (await _routes(state["bootstrap_servers"]))[before:]]
                    hung.append(max(("0", "1"), key=taken.count))
                    pid = up.wait_ready()["pids"]["scheduler" if hung[0] == "0" else "scheduler-1"]
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(4)
                    finally:
                        os.kill(pid, signal.SIGCONT)

                before = len(await _routes(state["bootstrap_servers"]))
                check(await _round(client, hang), "hung")
                handed = [
                    r
                    for r in (await _routes(state["bootstrap_servers"]))[before:]
                    if r.from_index and r.replica
                ]
                other = {"0": "1", "1": "0"}[hung[0]]
                assert handed and {r.replica for r in handed} == {other}, (hung, handed)

                # 3. kill -9 the first of the two tokenizers: its successor reads the routing
                # journal and sends each of its streams back to the replica that runs it (nothing
                # is routed twice); the other tokenizer's streams go on meanwhile.
                async def kill_tokenizer() -> None:
                    old = up.wait_ready()["pids"]["tokenizer"]
                    os.kill(old, signal.SIGKILL)
                    await _wait_for_new_pid(up, "tokenizer", old)

                before = len(await _routes(state["bootstrap_servers"]))
                check(await _round(client, kill_tokenizer), "tokenizer killed")
                fresh = [r for r in (await _routes(state["bootstrap_servers"]))[before:] if r.from_index == 0]
                assert len({r.request_id for r in fresh}) == len(fresh) == len(PROMPTS), fresh

        asyncio.run(main())
    except AssertionError:
        print(up.output())
        raise
    finally:
        code = up.stop()
    assert code == 0, up.output()


def test_a_replica_started_while_serving_takes_requests(tmp_path):
    up = Up(tmp_path / "home", "--router", "least-loaded")
    extra: list[subprocess.Popen] = []
    try:
        state = up.wait_ready()
        bootstrap = state["bootstrap_servers"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for service in ("executor", "scheduler"):
            cmd = [sys.executable, "-P", "-m", "parkade.cli", service, "--bootstrap-servers", bootstrap]
            log = (tmp_path / f"{service}-7.log").open("w")
            extra.append(subprocess.Popen([*cmd, "--replica", "7"], env=env, stdout=log, stderr=log))
        _wait_serving(state, {"0", "7"})

        async def main() -> set[str]:
            async with Client(bootstrap) as client:

                async def one(i: int) -> None:
                    params = SamplingParams(max_tokens=40, temperature=0)
                    async for _ in client.generate(prompt=PROMPTS[i % len(PROMPTS)], sampling_params=params):
                        pass

                await asyncio.gather(*(one(i) for i in range(8)))
            return {r.replica for r in await _routes(bootstrap)}

        assert asyncio.run(main()) == {"0", "7"}
    except AssertionError:
        print(up.output())
        for service in ("executor", "scheduler"):
            print((tmp_path / f"{service}-7.log").read_text()[-3000:])
        raise
    finally:
        for proc in extra:
            proc.send_signal(signal.SIGTERM)
        for proc in extra:
            proc.wait(30)
        code = up.stop()
    assert code == 0, up.output()
