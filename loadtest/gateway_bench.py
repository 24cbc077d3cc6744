"""What the HTTP gateway adds: the same workload through the OpenAI API and through the Kafka client.

    python loadtest/gateway_bench.py [--num-requests 64] [--max-tokens 32] [--request-rate inf]
        [--rounds 2] [--endpoint completions|chat] [--up-args "..."]

Starts `parkade up --http-port 0` (its own PARKADE_HOME in a temp folder, the shipped model unless
--up-args says otherwise), waits until the gateway's /health is 200, sends a warm-up request each
way, then runs the workload `--rounds` times on each path, alternating (Kafka, HTTP, Kafka, ...),
so that a slower minute of the machine falls on both:

- Kafka: `parkade.client.Client` (one client, its own reply topic), as `parkade generate` does.
- HTTP: streaming requests with `stream_options.include_usage` over httpx
  (`openai_load.send_one`), as the `openai` package sends them.

Same prompts, `max_tokens`, `ignore_eos` (every request yields exactly --max-tokens tokens),
greedy, same arrival schedule (`openai_load.arrival_times`). TTFT = first chunk or event with
text - send; ITL = gaps between successive chunks/events with text; e2e = last event (Kafka) or
`[DONE]` (HTTP) - send; throughput = output tokens / wall time of the run. Prints one JSON
document with each path's pooled statistics, the gateway's added TTFT (p50 and mean of HTTP
minus Kafka) and its throughput as a fraction of the Kafka client's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from openai_load import DEFAULT_PROMPTS, RequestResult, arrival_times, build_request, send_one, summarize

from parkade import SamplingParams
from parkade.client import Client


def start_up(home: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PARKADE_HOME": str(home)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    log = (home / "up.log").open("w")
    cmd = [sys.executable, "-P", "-m", "parkade.cli", "up", "--http-port", "0", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    state_file = home / "up.json"
    deadline = time.monotonic() + 300
    while not state_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"parkade up did not start:\n{(home / 'up.log').read_text()[-3000:]}")
        time.sleep(0.5)
    state = json.loads(state_file.read_text())
    health = state["gateway_url"].removesuffix("/v1") + "/health"
    while httpx.get(health).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway never became healthy")
        time.sleep(0.5)
    return proc, state


async def kafka_one(client: Client, prompt: str, params: SamplingParams) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    try:
        async for event in client.generate(prompt=prompt, sampling_params=params):
            now = time.perf_counter() - start
            if event.error is not None:
                res.error = event.error
                break
            if event.text:
                if res.ttft is None:
                    res.ttft = now
                else:
                    res.itl.append(now - res.last_content)
                res.last_content = now
            if event.finish_reason is not None:
                res.done, res.e2e = True, now
                res.output_tokens = event.usage.completion_tokens if event.usage else None
    except Exception as error:
        res.error = f"{type(error).__name__}: {error}"
    return res


async def run_path(path: str, args: argparse.Namespace, state: dict, client: Client, http: httpx.AsyncClient):
    offsets = arrival_times(args.num_requests, args.request_rate, "poisson", 0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    base = state["gateway_url"]
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        prompt = DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)]
        if path == "kafka":
            return await kafka_one(client, prompt, params)
        route, body = build_request(args.endpoint, "stories260K", prompt, args.max_tokens, 0.0, None, True)
        body.pop("model")  # the served model, whatever --up-args named
        return await send_one(http, base + route, body, args.endpoint, 300.0)

    results = await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    return results, time.perf_counter() - t0


async def measure(args: argparse.Namespace, state: dict) -> dict:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: dict[str, list[RequestResult]] = {"kafka": [], "http": []}
    durations: dict[str, float] = {"kafka": 0.0, "http": 0.0}
    async with (
        Client(state["bootstrap_servers"], state["topic_prefix"]) as client,
        httpx.AsyncClient(timeout=300, limits=limits) as http,
    ):
        warm = argparse.Namespace(**{**vars(args), "num_requests": 1})
        for path in ("kafka", "http"):
            await run_path(path, warm, state, client, http)
        for _ in range(args.rounds):
            for path in ("kafka", "http"):
                got, seconds = await run_path(path, args, state, client, http)
                results[path] += got
                durations[path] += seconds
    paths = {path: summarize(results[path], durations[path]) for path in results}
    kafka, gateway = paths["kafka"], paths["http"]
    return {
        "paths": paths,
        "gateway_added_ttft_ms": {
            k: round(gateway["ttft_ms"][k] - kafka["ttft_ms"][k], 3) for k in ("mean", "p50", "p90")
        },
        "gateway_throughput_vs_kafka": round(
            gateway["output_throughput_tok_s"] / kafka["output_throughput_tok_s"], 3
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: all at once)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--up-args", default="", help="more `parkade up` flags, one string")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, state = start_up(Path(tmp), shlex.split(args.up_args))
        try:
            report = asyncio.run(measure(args, state))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report = {
        "workload": {
            k: v if not (isinstance(v, float) and math.isinf(v)) else "inf" for k, v in vars(args).items()
        },
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        **report,
    }
    print(json.dumps(report, indent=2))
    failed = sum(p["failed"] for p in report["paths"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
