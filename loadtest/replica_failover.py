"""Failover through Kafka with N simulated replicas: a replica's scheduler killed (and restarted
by `parkade up` after the hand-over timeout), then a tokenizer killed, under load; every stream
against a failure-free run of the same requests in one process.

    python loadtest/replica_failover.py [--replicas 4] [--tokenizers 2] [--streams 32]

`parkade up --replicas N --tokenizers T --simulate h200:llama-3-8b` (speed-up 5, so that the
steps batch many streams), `--replica-timeout-s 2`; each round sends every stream at once (seeded
sampling, `ignore_eos`), kills its victim with SIGKILL once every stream has `--kill-at` tokens,
and waits for every stream's last event. A stream is lost when it has no final event, has a gap
or a repeat when its indices skip or come twice, and differs when its tokens are not those of
`LLM(simulate=...)` for the same request. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parkade import LLM, SamplingParams
from parkade.client import Client

SIMULATE = "h200:llama-3-8b"
SPEEDUP = 5.0


def params(i: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)


def prompt(i: int) -> str:
    return f"Story {i}: once upon a time, a child named {i % 7} went to the sea."


def wait_for(path: Path, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} in {timeout_s:g} s")
        time.sleep(0.5)
    return json.loads(path.read_text())


async def one_round(client: Client, state_file: Path, victim: str, args: argparse.Namespace) -> dict:
    events: list[list] = [[] for _ in range(args.streams)]

    async def stream(i: int) -> None:
        async for event in client.generate(
            prompt=prompt(i), sampling_params=params(i, args.max_tokens), timeout_s=300
        ):
            events[i].append(event)

    started = time.monotonic()
    tasks = asyncio.gather(*(stream(i) for i in range(args.streams)), return_exceptions=True)
    while min(sum(len(e.token_ids) for e in es) for es in events) < args.kill_at:
        await asyncio.sleep(0.01)
    pid = json.loads(state_file.read_text())["pids"][victim]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    results = await asyncio.wait_for(tasks, 600)
    return {
        "victim": victim,
        "killed_after_s": round(killed - started, 2),
        "round_s": round(time.monotonic() - started, 2),
        "errors": [repr(r) for r in results if isinstance(r, BaseException)],
        "events": events,
    }


def judge(events: list[list], expected: list) -> dict:
    lost = gaps = differ = 0
    for got, want in zip(events, expected, strict=True):
        if not got or got[-1].finish_reason is None:
            lost += 1
            continue
        indices = [e.index for e in got if e.token_ids]
        if indices != sorted(set(indices)):
            gaps += 1
        if [t for e in got for t in e.token_ids] != list(want.token_ids):
            differ += 1
    return {"streams": len(events), "lost": lost, "gaps_or_repeats": gaps, "differ": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tokenizers", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=40)
    args = parser.parse_args()
    llm = LLM(simulate=SIMULATE, simulate_speedup=1e6)
    expected = [
        o.outputs[0]
        for o in llm.generate(
            [prompt(i) for i in range(args.streams)],
            [params(i, args.max_tokens) for i in range(args.streams)],
            use_tqdm=False,
        )
    ]
    home = Path(tempfile.mkdtemp(prefix="parkade-failover-"))
    env = {**os.environ, "PARKADE_HOME": str(home)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    cmd = [
        sys.executable, "-P", "-m", "parkade.cli", "up", "--http-port", "0",
        "--replicas", str(args.replicas), "--tokenizers", str(args.tokenizers),
        "--simulate", SIMULATE, "--simulate-speedup", str(SPEEDUP), "--replica-timeout-s", "2",
        "--split-replicas",  # a replica's scheduler alone is the victim
        "--split-tokenizer",  # and a tokenizer alone
    ]  # fmt: skip
    log = (home / "up.log").open("w")
    up = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    rounds = []
    try:
        state = wait_for(home / "up.json")
        time.sleep(3)  # every replica's executor joined and said so

        async def run() -> None:
            async with Client(state["bootstrap_servers"]) as client:
                for victim in (f"scheduler-{args.replicas - 1}", "tokenizer"):
                    result = await one_round(client, home / "up.json", victim, args)
                    verdict = judge(result.pop("events"), expected)
                    rounds.append({**result, **verdict})

        asyncio.run(run())
        logs = [p.read_text() for p in (home / "logs").glob("tokenizer*.log")]
        handovers = sum(text.count("goes on elsewhere") for text in logs)
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    print(
        json.dumps(
            {
                "benchmark": "replica_failover",
                "settings": vars(args) | {"simulate": SIMULATE, "speedup": SPEEDUP, "replica_timeout_s": 2},
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                "rounds": rounds,
                "handovers_logged": handovers,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
