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
from collections.abc import Callable

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


class Journal:
    """The tokenizers' routing journal (`RequestRouted` on the requests topic), read from its
    start by one consumer that stays open. `until` reads on until a condition holds: a read
    that comes back empty is not "all of it" (the broker's reads can lag its writes)."""

    def __init__(self, bootstrap: str) -> None:
        self.bus = KafkaBus(bootstrap, client_id="test-routes")
        self.routes: list[RequestRouted] = []
        self.consumer = None

    async def __aenter__(self) -> Journal:
        name = topics.topic_name(topics.REQUESTS)
        self.consumer = await self.bus.consumer([name], None, start={name: 0})
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.consumer.stop()
        await self.bus.close()

    def of(self, ids: list[str]) -> list[RequestRouted]:
        return [r for r in self.routes if r.request_id in ids]

    async def until(self, what: str, holds: Callable[[], bool], timeout_s: float = 30.0) -> None:
        decoder = topics.TopicDecoder(topics.REQUESTS)
        deadline = time.monotonic() + timeout_s
        while not holds():
            assert time.monotonic() < deadline, (f"not within {timeout_s:g} s: {what}", self.routes)
            for record in await self.consumer.getmany(timeout_ms=200):
                message = decoder.decode(record.value, record.header(topics.CONTENT_TYPE))
                if isinstance(message, RequestRouted):
                    self.routes.append(message)


def _running_on(routes: list[RequestRouted]) -> dict[str, str]:
    """Each sample's replica by its latest route ("" while handed over and waiting)."""
    return {r.request_id: r.replica for r in routes}


async def _round(client: Client, tag: str, disturb) -> tuple[list[str], list[list]]:
    """Every prompt at once, as requests `tag`-i; `disturb(ids)` once each stream has 30
    tokens; -> the request ids and each stream's events."""
    ids = [f"{tag}-{i}" for i in range(len(PROMPTS))]
    events: list[list] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        stream = client.generate(
            prompt=PROMPTS[i], sampling_params=_seeded(i), request_id=ids[i], timeout_s=240
        )
        async for event in stream:
            events[i].append(event)

    streams = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    while min(sum(len(e.token_ids) for e in es) for es in events) < 30:
        await asyncio.sleep(0.005)
    await disturb(ids)
    await asyncio.wait_for(streams, 240)
    return ids, events


def test_two_replicas_lose_nothing_when_one_is_killed_or_hangs(tmp_path):
    expected = [o.outputs[0] for o in LLM().generate(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])]
    # Split replicas: a scheduler killed or hung while its executor serves on.
    up = Up(tmp_path / "home", "--replicas", "2", "--tokenizers", "2", "--split-replicas", *FAST_HANDOVER)
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
            bootstrap = state["bootstrap_servers"]
            async with Client(bootstrap) as client, Journal(bootstrap) as journal:
                # 1. kill -9 replica 1's scheduler: `parkade up` restarts it, and it resumes its own.
                async def kill(ids: list[str]) -> None:
                    old = up.wait_ready()["pids"]["scheduler-1"]
                    os.kill(old, signal.SIGKILL)
                    await _wait_for_new_pid(up, "scheduler-1", old)

                ids, events = await _round(client, "killed", kill)
                check(events, "killed")
                took = lambda: {r.replica for r in journal.of(ids) if r.replica}  # noqa: E731
                await journal.until("both replicas took streams", lambda: took() == {"0", "1"})

                # 2. a replica's scheduler hangs past the timeout: its streams go on at the other,
                # and once it wakes its copies are aborted (never run twice to completion). It
                # hangs until every stream it ran is handed over (the journal says so), not for
                # a fixed time that a loaded machine may need more than.
                # NOTE: the replica that runs the most of this round's streams: the router may
                # send them all to one (seen in CI: replica 1 had none after round 1's hand-over).
                hung: list[str] = []
                on_hung: list[str] = []

                async def hang(ids: list[str]) -> None:
                    await journal.until(
                        "each stream routed", lambda: set(_running_on(journal.of(ids))) == set(ids)
                    )
                    running = _running_on(journal.of(ids))
                    hung.append(max(("0", "1"), key=list(running.values()).count))
                    on_hung.extend(i for i in ids if running[i] == hung[0])
                    pid = up.wait_ready()["pids"]["scheduler" if hung[0] == "0" else "scheduler-1"]
                    os.kill(pid, signal.SIGSTOP)
                    try:
                        await journal.until(
                            f"replica {hung[0]}'s streams handed over (timeout {FAST_HANDOVER[1]} s)",
                            lambda: (
                                {r.request_id for r in journal.of(on_hung) if r.from_index} == set(on_hung)
                            ),
                        )
                    finally:
                        os.kill(pid, signal.SIGCONT)

                ids, events = await _round(client, "hung", hang)
                check(events, "hung")
                other = {"0": "1", "1": "0"}[hung[0]]

                def handed() -> list[RequestRouted]:
                    return [r for r in journal.of(on_hung) if r.from_index and r.replica]

                await journal.until(
                    "every handed-over stream routed again",
                    lambda: {r.request_id for r in handed()} == set(on_hung),
                )
                assert on_hung and {r.replica for r in handed()} == {other}, (hung, journal.of(ids))

                # 3. kill -9 the first of the two tokenizers: its successor reads the routing
                # journal and sends each of its streams back to the replica that runs it (nothing
                # is routed twice); the other tokenizer's streams go on meanwhile.
                async def kill_tokenizer(ids: list[str]) -> None:
                    old = up.wait_ready()["pids"]["tokenizer"]
                    os.kill(old, signal.SIGKILL)
                    await _wait_for_new_pid(up, "tokenizer", old)

                ids, events = await _round(client, "tokenizer-killed", kill_tokenizer)
                check(events, "tokenizer killed")
                fresh = lambda: [r for r in journal.of(ids) if r.from_index == 0]  # noqa: E731
                await journal.until(
                    "each stream's first route", lambda: {r.request_id for r in fresh()} == set(ids)
                )
                assert len(fresh()) == len(PROMPTS), fresh()

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
            async with Journal(bootstrap) as journal:
                took = lambda: {r.replica for r in journal.routes}  # noqa: E731
                await journal.until("replica 7 took a request", lambda: "7" in took())
                return took()

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
