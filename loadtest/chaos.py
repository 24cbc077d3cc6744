"""A soak run under faults: Poisson arrivals through `parkade up` while a random service is killed
(SIGKILL) every few seconds; every request is checked against the in-process engine.

    python loadtest/chaos.py [--duration-s 180] [--rate 2] [--kill-every-s 20] [--model DIR]

`parkade up` runs as a child with its own PARKADE_HOME (embedded Tansu broker, the shipped
stories260K unless --model) and restarts each killed service. Requests: half greedy, half
seeded sampling, `ignore_eos`, max_tokens drawn from [--min-tokens, --max-tokens]. At the end,
the same requests run through `LLM` in this process, and each stream is judged:

    completed   finished with its max_tokens, the engine's tokens and text
    mismatched  finished, but its tokens or text differ from the engine's
    gaps        its token indices are not 0, 1, 2, ... (a token repeated or skipped)
    failed      ended with an error event (its error is counted by kind)
    lost        no end: the client's idle timeout or the run's deadline passed

Peak memory: the largest resident set seen for each service (sampled every 0.5 s, across its
restarts), and the broker's. Prints one JSON document. The goal: zero lost, zero gaps, zero
mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from parkade import LLM, SamplingParams
from parkade.client import Client, PipelineGoneError
from parkade.models import DEFAULT_MODEL

OPENINGS = [
    "Once upon a time",
    "Lily and Tom",
    "The big dog",
    "One day, a girl",
    "Tim had a red ball",
    "The sun was hot",
    "Sue liked to sing",
    "A little bird",
    "Mom said",
    "The cat sat",
]
SERVICES = ("tokenizer", "scheduler", "executor")


@dataclass
class Outcome:
    prompt: str
    params: SamplingParams
    events: list = field(default_factory=list)
    error: str | None = None  # an exception on the client's side (lost)


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def start_up(home: Path, model: Path) -> subprocess.Popen:
    env = {**os.environ, "PARKADE_HOME": str(home)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    log = (home / "up.log").open("w")
    cmd = [sys.executable, "-P", "-m", "parkade.cli", "up", "--dtype", "float32", "--model", str(model)]
    cmd += ["--split-replicas", "--split-tokenizer"]  # each service killed on its own
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def read_state(home: Path, up: subprocess.Popen, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (home / "up.json").exists():
        if up.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"parkade up did not start:\n{(home / 'up.log').read_text()[-3000:]}")
        time.sleep(0.5)
    return json.loads((home / "up.json").read_text())


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    home = Path(tempfile.mkdtemp(prefix="parkade-chaos-"))
    up = start_up(home, args.model)
    state = read_state(home, up)
    outcomes: list[Outcome] = []
    kills: list[dict] = []
    peak: dict[str, float] = collections.defaultdict(float)
    stop = asyncio.Event()

    async def sample_memory() -> None:
        while not stop.is_set():
            pids = json.loads((home / "up.json").read_text())["pids"] if (home / "up.json").exists() else {}
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss_mib(pid))
            await asyncio.sleep(0.5)

    async def killer(t0: float) -> None:
        while True:
            await asyncio.sleep(args.kill_every_s)
            if stop.is_set():
                return
            name = rng.choice(SERVICES)
            pid = json.loads((home / "up.json").read_text())["pids"][name]
            os.kill(pid, signal.SIGKILL)
            kills.append({"at_s": round(time.monotonic() - t0, 1), "service": name})

    async def one(client: Client, outcome: Outcome) -> None:
        try:
            async for event in client.generate(
                prompt=outcome.prompt, sampling_params=outcome.params, timeout_s=args.request_timeout_s
            ):
                outcome.events.append(event)
        except (PipelineGoneError, TimeoutError) as error:
            outcome.error = f"{type(error).__name__}: {error}"

    async with Client(state["bootstrap_servers"]) as client:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(sample_memory()), asyncio.create_task(killer(t0))]
        streams = []
        i = 0
        while time.monotonic() - t0 < args.duration_s:
            seeded = i % 2 == 1
            params = SamplingParams(
                temperature=1.0 if seeded else 0.0,
                seed=1000 + i if seeded else None,
                max_tokens=rng.randint(args.min_tokens, args.max_tokens),
                ignore_eos=True,
            )
            outcome = Outcome(f"{rng.choice(OPENINGS)} {i}", params)
            outcomes.append(outcome)
            streams.append(asyncio.create_task(one(client, outcome)))
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        stop.set()
        await asyncio.gather(*streams)
        wall_s = time.monotonic() - t0
        for task in tasks:
            task.cancel()
    up.send_signal(signal.SIGTERM)
    up.wait(120)

    expected = LLM(args.model, dtype="float32").generate(
        [o.prompt for o in outcomes], [o.params for o in outcomes]
    )
    counts = collections.Counter()
    errors = collections.Counter()
    lost = collections.Counter()
    for outcome, want in zip(outcomes, expected, strict=True):
        events = outcome.events
        if outcome.error is not None or not events or events[-1].finish_reason is None:
            counts["lost"] += 1
            lost[re.sub(r"[0-9a-f]{32}", "<id>", outcome.error or "no end")] += 1
            continue
        if events[-1].finish_reason == "error":
            counts["failed"] += 1
            errors[re.sub(r"[0-9a-f]{32}", "<id>", events[-1].error or "")[:120]] += 1
            continue
        indices = [(e.index, len(e.token_ids)) for e in events if e.token_ids]
        position = 0
        for index, n in indices:
            if index != position:
                counts["gaps"] += 1
                break
            position += n
        tokens = [t for e in events for t in e.token_ids]
        text = "".join(e.text for e in events)
        if tokens != want.outputs[0].token_ids or text != want.outputs[0].text:
            counts["mismatched"] += 1
        else:
            counts["completed"] += 1
    restarts = (home / "up.log").read_text().count("parkade up: restarting the")
    # A restarted scheduler that found a live request's history cut short (see recover()).
    history_gaps = (home / "logs" / "scheduler.log").read_text().count("it starts again")
    return {
        "benchmark": "chaos",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "model": str(args.model),
        "duration_s": args.duration_s,
        "wall_s": round(wall_s, 1),
        "rate_per_s": args.rate,
        "kill_every_s": args.kill_every_s,
        "requests": len(outcomes),
        "completed": counts["completed"],
        "lost": counts["lost"],
        "lost_by_error": dict(lost),
        "gaps": counts["gaps"],
        "mismatched": counts["mismatched"],
        "failed": counts["failed"],
        "failed_by_error": dict(errors),
        "kills": collections.Counter(k["service"] for k in kills),
        "restarts_by_parkade_up": restarts,
        "scheduler_history_gaps": history_gaps,
        "peak_rss_mib": {name: round(v, 1) for name, v in sorted(peak.items())},
        "output_tokens": sum(len(e.token_ids) for o in outcomes for e in o.events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long requests arrive")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests per second (Poisson)")
    parser.add_argument("--kill-every-s", type=float, default=20.0, help="seconds between two kills")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args)), indent=2))


if __name__ == "__main__":
    main()
