"""One engine at scale at GPU speed: Parkade's scheduler over the simulated executor with 4,096+
running requests; who bounds the steps per second, the scheduler or the GPU?

    python loadtest/sim_scale_bench.py [--simulate h200:llama-3-8b] [--sizes 1024,4096,8192]

For each size N: N requests (prompts of `--prompt-len` token ids, `ignore_eos`, `--max-tokens`)
are added at once to a `Scheduler` sized as the scheduler service sizes it from the simulated
executor's announcement (the pool from the GPU's memory; max_num_seqs = N; 8,192 tokens a step)
and run to the end, two steps in flight as the service runs them. Per step: the scheduler's time
(`schedule` + `update`, and encoding the plan, the result and the step's events as the service
sends them: msgspec), the simulated executor's host time (its bookkeeping, not waiting:
speedup 1e9) and the GPU's predicted time. With steps pipelined, a step takes the longer of the
GPU's time and the scheduler's: that is the bound. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

from parkade.schemas import EngineRequest, GeneratedBatch, SamplingParams, StepPlan, StepResult, topics
from parkade.services.executor.build import build_executor
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler.config import KVGeometry, SchedulerConfig, SchedulingOptions
from parkade.services.scheduler.scheduler import Scheduler


def run(simulate: str, size: int, prompt_len: int, max_tokens: int) -> dict:
    executor, max_model_len = build_executor(ExecutorOptions(simulate=simulate, simulate_speedup=1e9))
    options = SchedulingOptions(max_num_seqs=size, max_num_batched_tokens=8192, max_waiting_requests=size)
    scheduler = Scheduler(SchedulerConfig.build(options, KVGeometry(executor.num_blocks, 16, max_model_len)))
    rng = random.Random(size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(size):
        prompt = tuple(rng.randrange(3, 500) for _ in range(prompt_len))
        scheduler.add(EngineRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    in_flight: list[tuple[StepPlan, StepResult]] = []
    rows = []  # (running, scheduler s, executor host s, GPU s)
    gc.collect()
    while scheduler.has_unfinished_requests() or in_flight:
        start = time.perf_counter()
        plan = scheduler.schedule()
        encoded = topics.ENCODER.encode(plan)
        scheduling = time.perf_counter() - start
        start = time.perf_counter()
        result = executor.execute(plan)
        host = time.perf_counter() - start
        gpu = executor.stats.step_times[-1] if plan.num_scheduled_tokens else 0.0
        if plan.num_scheduled_tokens:
            in_flight.append((plan, result))
        if in_flight and (len(in_flight) == 2 or not plan.num_scheduled_tokens):
            oldest, answer = in_flight.pop(0)
            start = time.perf_counter()
            topics.ENCODER.encode(answer)
            events = scheduler.update(oldest, answer)
            if events:
                topics.ENCODER.encode(GeneratedBatch(events=tuple(events)))
            scheduling += time.perf_counter() - start
        if plan.num_scheduled_tokens:
            rows.append((len(plan.num_scheduled_tokens), scheduling, host, gpu, len(encoded)))
    decode = [r for r in rows if r[0] == size]  # every request in the step
    gpu_s = sum(r[3] for r in rows)
    pipelined_s = sum(max(r[1], r[3]) for r in rows)
    return {
        "running": size,
        "kv_blocks": executor.num_blocks,
        "steps": len(rows),
        "decode_steps_all_running": len(decode),
        "gpu_step_ms_p50": round(statistics.median(r[3] for r in decode) * 1e3, 2) if decode else None,
        "scheduler_ms_per_step_p50": round(statistics.median(r[1] for r in decode) * 1e3, 2)
        if decode
        else None,
        "executor_host_ms_per_step_p50": round(statistics.median(r[2] for r in decode) * 1e3, 2)
        if decode
        else None,
        "plan_bytes_p50": round(statistics.median(r[4] for r in decode)) if decode else None,
        "steps_per_s_at_gpu_speed": round(len(rows) / pipelined_s, 1),
        "output_tokens_per_s_at_gpu_speed": round(size * max_tokens / pipelined_s),
        "scheduler_bound_steps": sum(r[1] > r[3] for r in rows),
        "bound": "scheduler" if sum(r[1] for r in rows) > gpu_s else "executor (the GPU)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--simulate", default="h200:llama-3-8b")
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    results = [run(args.simulate, int(n), args.prompt_len, args.max_tokens) for n in args.sizes.split(",")]
    print(
        json.dumps(
            {
                "benchmark": "sim_scale",
                "simulate": args.simulate,
                "settings": vars(args),
                "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
