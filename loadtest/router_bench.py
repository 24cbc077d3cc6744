"""Engine replicas and the routing policies side by side, at GPU speed in virtual time.

    python loadtest/router_bench.py [--simulate h200:llama-3-8b] [--quick] [--out docs/plots]

Each replica is Parkade's own scheduler core over the simulated executor (its roofline step
times; speedup 1e9, so nothing waits), with its `ReplicaPublisher` (the status and KV events it
would send); one `Router` (the tokenizer's) reads them and routes every request, exactly as the
services do, except that the clock is virtual: a step ends when the GPU would have finished it,
plus `HOP_S` for the trip through Kafka. So N GPUs are measured without N GPUs and without N
processes on two cores.

Workloads (each with every policy in the same run, the same arrivals):

    no-sharing    256 x N requests at once, prompts 128-2,048, outputs 64-512 (as the pipeline
                  bench): throughput at N = 1, 2, 4
    multi-tenant  24 tenants with a 4,096-token system prompt, users' questions 128-512 tokens,
                  outputs 64-256, Poisson arrivals at a sweep of rates; 4 replicas whose pools hold
                  a third of the tenants' prefixes each (the cluster's: all of them); and one
                  replica with 4x the pool and 4x the speed, for the hit rate a single pool gets
    hot-prefix    every request behind one 2,048-token prefix, Poisson arrivals: the spread of
                  requests over the replicas and the throughput
    restart       multi-tenant at one rate; the router is replaced mid-run by a new one that reads
                  the KV events again (a restarted tokenizer): predicted vs real hits after it

Also: the routing cost of an 8k-token prompt against 4 replicas with full indexes (wall clock),
and the KV-event bytes per second. Prints one JSON document; with --out, PNG plots and the JSON.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import platform
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from parkade.schemas import EngineRequest, KVEvents, ReplicaStatus, SamplingParams
from parkade.services.common.simulation import Simulation
from parkade.services.executor.simulated import SimulatedExecutor
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions
from parkade.services.scheduler.replica import ReplicaPublisher
from parkade.services.scheduler.scheduler import Scheduler
from parkade.services.tokenizer.router import POLICIES, Router

BLOCK = 16
HOP_S = 0.004  # a step's round trip through Kafka at GPU pace (issue 23: ~2 ms a hop)
STATUS_TICK_S = 0.5
MAX_MODEL_LEN = 8192


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: float
    session: str | None = None
    replica: str = ""
    predicted_blocks: int = 0
    real_blocks: int = 0
    first_token: float | None = None
    done: float | None = None
    routed_after_restart: bool = False


@dataclass(eq=False)
class Replica:
    name: str
    scheduler: Scheduler
    executor: SimulatedExecutor
    publisher: ReplicaPublisher
    speed: float = 1.0
    busy: bool = False
    requests: int = 0
    live: dict[str, Request] = field(default_factory=dict)


def make_replica(
    name: str, simulation: Simulation, num_blocks: int, clock: Clock, speed: float = 1.0
) -> Replica:
    options = SchedulingOptions(max_num_seqs=256, max_waiting_requests=1_000_000, max_waiting_tokens=10**12)
    scheduler = Scheduler(SchedulerConfig.build(options, KVGeometry(num_blocks, BLOCK, MAX_MODEL_LEN)))
    executor = SimulatedExecutor(
        simulation,
        vocab_size=32_000,
        block_size=BLOCK,
        num_blocks=num_blocks,
        speedup=1e9,
        sleep=lambda _: None,
    )
    publisher = ReplicaPublisher(name, f"sched-{name}", clock=clock, wall_clock=clock)
    publisher.attach(scheduler.kv.pool)
    return Replica(name, scheduler, executor, publisher, speed)


class Cluster:
    """Replicas and a router in virtual time (see the module)."""

    def __init__(self, replicas: list[Replica], policy: str, clock: Clock, seed: int = 0) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.policy, self.clock, self.seed = policy, clock, seed
        self.router = self._new_router()
        self.heap: list = []
        self.order = itertools.count()
        self.log: list[ReplicaStatus | KVEvents] = []  # the kv-events topic
        self.output_tokens = 0
        self.restarted_at: float | None = None

    def _new_router(self) -> Router:
        return Router(self.policy, clock=self.clock, wall_clock=self.clock, seed=self.seed)

    def run(
        self, requests: list[Request], restart_at: float | None = None, progress: tqdm | None = None
    ) -> None:
        self._push(0.0, "tick", None)  # first: the replicas' statuses, before any request
        for request in requests:
            self._push(request.arrival, "arrive", request)
        if restart_at is not None:
            self._push(restart_at, "restart", None)
        pending = len(requests)
        while pending:
            when, _, kind, payload = heapq.heappop(self.heap)
            self.clock.now = when
            if kind == "arrive":
                self._route(payload)
            elif kind == "step":
                pending -= self._step_done(*payload, progress)
            elif kind == "tick":
                self._publish_all()
                self._push(when + STATUS_TICK_S, "tick", None)
            elif kind == "restart":
                self._restart_router()

    def _push(self, when: float, kind: str, payload: object) -> None:
        heapq.heappush(self.heap, (when, next(self.order), kind, payload))

    def _route(self, request: Request) -> None:
        decision = self.router.route(request.prompt, session_id=request.session)
        assert decision is not None, "every replica is alive in this bench"
        replica = self.replicas[decision.replica]
        request.replica, request.predicted_blocks = replica.name, decision.predicted_blocks
        request.routed_after_restart = (
            self.restarted_at is not None and self.clock.now - self.restarted_at <= 5.0
        )
        self.router.opened(replica.name, decision.prompt_blocks - decision.predicted_blocks)
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True, temperature=0.0)
        engine = EngineRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt, sampling_params=params
        )
        replica.scheduler.add(engine)
        replica.live[request.request_id] = request
        replica.requests += 1
        if not replica.busy:
            self._start_step(replica)

    def _start_step(self, replica: Replica) -> None:
        plan = replica.scheduler.schedule()
        if not (plan.num_scheduled_tokens or plan.finished_request_ids or plan.preempted_request_ids):
            replica.busy = False
            return
        result = replica.executor.execute(plan)
        step_s = replica.executor.stats.step_times[-1] / replica.speed if plan.num_scheduled_tokens else 0.0
        replica.busy = True
        self._push(self.clock.now + step_s + HOP_S, "step", (replica, plan, result))

    def _step_done(self, replica: Replica, plan, result, progress: tqdm | None) -> int:
        done = 0
        for event in replica.scheduler.update(plan, result):
            request = replica.live.get(event.request_id)
            if request is None:
                continue
            self.output_tokens += len(event.token_ids)
            if request.first_token is None and event.token_ids:
                request.first_token = self.clock.now
                request.real_blocks = event.num_cached_tokens // BLOCK
                self.router.first_token(replica.name, 0, event.num_cached_tokens)
            if event.finish_reason is not None:
                request.done = self.clock.now
                del replica.live[event.request_id]
                self.router.closed(replica.name, 0, True)
                done += 1
                if progress is not None:
                    progress.update()
        self._publish(replica)
        self._start_step(replica)
        return done

    def _publish(self, replica: Replica, force: bool = False) -> None:
        for out in replica.publisher.records(replica.scheduler, serving=True, num_pending=0, force=force):
            self.log.append(out.message)
            if isinstance(out.message, ReplicaStatus):
                self.router.on_status(out.message)
            else:
                self.router.on_kv_events(out.message)

    def _publish_all(self) -> None:
        for replica in self.replicas.values():
            self._publish(replica)

    def _restart_router(self) -> None:
        """A new router that reads the kv-events log again (a restarted tokenizer), and counts
        the open streams it reads again."""
        self.router = self._new_router()
        for message in self.log:
            if isinstance(message, ReplicaStatus):
                self.router.on_status(message)
            else:
                self.router.on_kv_events(message)
        for replica in self.replicas.values():
            for _ in replica.live:
                self.router.opened(replica.name, 0)
        self.restarted_at = self.clock.now


def summarize(cluster: Cluster, requests: list[Request]) -> dict:
    ttft = sorted(r.first_token - r.arrival for r in requests)
    start = min(r.arrival for r in requests)
    end = max(r.done for r in requests)
    stats = [r.scheduler.stats() for r in cluster.replicas.values()]
    queries, hits = sum(s.num_prefix_queries for s in stats), sum(s.num_prefix_hits for s in stats)
    counts = [r.requests for r in cluster.replicas.values()]
    predicted = sum(r.predicted_blocks for r in requests)
    confirmed = sum(min(r.predicted_blocks, r.real_blocks) for r in requests)
    after = [r for r in requests if r.routed_after_restart]
    kv_bytes = sum(r.publisher.bytes_sent for r in cluster.replicas.values())

    def q(p: float) -> float:
        return round(ttft[min(len(ttft) - 1, int(p * len(ttft)))], 4)

    return {
        "requests": len(requests),
        "output_tok_per_s": round(cluster.output_tokens / (end - start)),
        "ttft_p50_s": q(0.5),
        "ttft_p90_s": q(0.9),
        "ttft_p99_s": q(0.99),
        "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "requests_per_replica": counts,
        "max_over_min": round(max(counts) / max(1, min(counts)), 3),
        "predicted_hit_blocks": predicted,
        "predicted_confirmed": round(confirmed / predicted, 4) if predicted else None,
        "predicted_confirmed_after_restart": round(
            sum(min(r.predicted_blocks, r.real_blocks) for r in after)
            / max(1, sum(r.predicted_blocks for r in after)),
            4,
        )
        if after
        else None,
        "kv_event_bytes_per_s": round(kv_bytes / (end - start)),
        "virtual_s": round(end - start, 2),
    }


# ---- workloads -------------------------------------------------------------------------------
def no_sharing(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"u{i}",
            tuple(rng.randrange(3, 32_000) for _ in range(rng.randint(128, 2048))),
            rng.randint(64, 512),
            0.0,
        )
        for i in range(256 * n)
    ]


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def multi_tenant(
    rate: float, duration: float, seed: int, tenants: int = 24, prefix: int = 4096
) -> list[Request]:
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(3, 32_000) for _ in range(prefix)) for _ in range(tenants)]
    out = []
    for i, t in enumerate(poisson(rate, duration, rng)):
        tenant = rng.randrange(tenants)
        user = rng.randrange(8)
        question = tuple(rng.randrange(3, 32_000) for _ in range(rng.randint(128, 512)))
        out.append(Request(f"m{i}", systems[tenant] + question, rng.randint(64, 256), t, f"{tenant}/{user}"))
    return out


def hot_prefix(rate: float, duration: float, seed: int) -> list[Request]:
    rng = random.Random(seed)
    system = tuple(rng.randrange(3, 32_000) for _ in range(2048))
    return [
        Request(
            f"h{i}",
            system + tuple(rng.randrange(3, 32_000) for _ in range(rng.randint(64, 256))),
            rng.randint(64, 256),
            t,
            f"s{i % 64}",
        )
        for i, t in enumerate(poisson(rate, duration, rng))
    ]


def run(
    simulation, workload, policy, *, replicas: int, blocks: int, speed: float = 1.0, restart_at=None
) -> dict:
    clock = Clock()
    cluster = Cluster(
        [make_replica(str(i), simulation, blocks, clock, speed) for i in range(replicas)], policy, clock
    )
    with tqdm(total=len(workload), desc=f"{policy} x{replicas}", leave=False, unit="req") as progress:
        cluster.run(workload, restart_at, progress)
    return summarize(cluster, workload)


def routing_cost(simulation, samples: int = 300) -> dict:
    """Wall-clock cost of routing an 8k-token prompt among 4 replicas with full indexes."""
    clock = Clock()
    router = Router("kv", clock=clock, wall_clock=clock, seed=0)
    rng = random.Random(1)
    for name in "0123":
        replica = make_replica(name, simulation, 1000, clock)
        for out in replica.publisher.records(replica.scheduler, serving=True, num_pending=0, force=True):
            if isinstance(out.message, ReplicaStatus):
                router.on_status(out.message)
        stored = tuple(rng.getrandbits(63) for _ in range(50_000))
        router.on_kv_events(
            KVEvents(replica=name, pool=replica.publisher.pool_id, seq=0, stored=stored, snapshot=True)
        )
    times = []
    for _ in range(samples):
        prompt = [rng.randrange(3, 32_000) for _ in range(8192)]
        start = time.perf_counter()
        router.route(prompt)
        times.append(time.perf_counter() - start)
    times.sort()
    return {
        "prompt_tokens": 8192,
        "replicas": 4,
        "indexed_blocks_per_replica": 50_000,
        "p50_ms": round(statistics.median(times) * 1e3, 3),
        "p99_ms": round(times[int(0.99 * len(times))] * 1e3, 3),
    }


def machine() -> str:
    """The CPU this ran on (the routing cost is wall clock; the rest is virtual time)."""
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor() or "cpu",
    ) if Path("/proc/cpuinfo").exists() else platform.processor() or "cpu"  # fmt: skip
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs"


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = results["multi_tenant"]["sweep"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in POLICIES:
        rows = [r for r in sweep if r["policy"] == policy]
        if not rows:
            continue
        left.plot([r["rate"] for r in rows], [r["ttft_p90_s"] for r in rows], marker="o", label=policy)
        right.plot([r["rate"] for r in rows], [r["output_tok_per_s"] for r in rows], marker="o", label=policy)
    left.set(xlabel="requests/s", ylabel="p90 TTFT (s)", yscale="log", title="multi-tenant, 4 replicas")
    right.set(xlabel="requests/s", ylabel="output tokens/s", title="throughput")
    left.legend()
    fig.tight_layout()
    fig.savefig(out / "router_multi_tenant.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulate", default="h200:llama-3-8b")
    parser.add_argument("--quick", action="store_true", help="fewer rates and shorter runs")
    parser.add_argument("--out", type=Path, help="folder for router_bench.json and the PNG plots")
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    simulation = Simulation.parse(args.simulate)
    policies = args.policies.split(",")
    duration = 20.0 if args.quick else 40.0
    results: dict = {
        "benchmark": "router",
        "simulate": args.simulate,
        "settings": vars(args) | {"out": str(args.out)},
    }

    # 1. No shared prefixes: throughput at N = 1, 2, 4 (pools as the simulated H200's).
    scaling = {}
    for n in (1, 2, 4):
        row = run(simulation, no_sharing(n, seed=n), "kv", replicas=n, blocks=53_765)
        scaling[n] = row
    base = scaling[1]["output_tok_per_s"]
    results["no_sharing"] = {
        "by_replicas": scaling,
        "scaling": {n: round(r["output_tok_per_s"] / (n * base), 3) for n, r in scaling.items()},
    }

    # 2. Multi-tenant: 24 tenants x 256 prefix blocks; each pool holds a third of them.
    prefix_blocks = 24 * 4096 // BLOCK
    blocks = prefix_blocks // 3 + 1500
    rates = (10, 20, 30, 40) if args.quick else (10, 20, 30, 40, 50, 60)
    sweep = []
    for rate in rates:
        workload_seed = int(rate * 10)
        for policy in policies:
            row = run(
                simulation, multi_tenant(rate, duration, workload_seed), policy, replicas=4, blocks=blocks
            )
            sweep.append({"rate": rate, "policy": policy, **row})
    one_pool = run(
        simulation,
        multi_tenant(rates[1], duration, int(rates[1] * 10)),
        "kv",
        replicas=1,
        blocks=4 * blocks,
        speed=4.0,
    )
    results["multi_tenant"] = {"pool_blocks_per_replica": blocks, "sweep": sweep, "one_pool_4x": one_pool}

    # 3. One hot prefix.
    hot = {}
    for policy in policies:
        hot[policy] = run(simulation, hot_prefix(40.0, duration, 7), policy, replicas=4, blocks=20_000)
    results["hot_prefix"] = hot

    # 4. A router restart mid-run.
    restart = run(
        simulation,
        multi_tenant(rates[1], duration, 99),
        "kv",
        replicas=4,
        blocks=blocks,
        restart_at=duration / 2,
    )
    results["restart"] = restart
    results["routing_cost"] = routing_cost(simulation)
    results["machine"] = machine()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "router_bench.json").write_text(text + "\n")
        plot(results, args.out)


if __name__ == "__main__":
    main()
