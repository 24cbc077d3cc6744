"""The pure scheduler's cost per decode step, from 64 to 4,096 running requests.

    python loadtest/scheduler_bench.py [--sizes 64,256,1024,4096] [--steps 200] [--prompt-len 512]
                                        [--repeats 3]

For each size N: N requests (prompts of `--prompt-len` tokens, `ignore_eos`, enough `max_tokens`
never to finish) are admitted and prefilled, then `--steps` decode steps are timed, each
`schedule()` + `update()` with a result that samples one token per request (two steps in flight, as
the scheduler service runs). Also per step: the plan's and the result's encoded size (msgspec, as
on the wire) and encode time. Every block the requests need exists (no preemption). No torch, no
I/O: this is the scheduler service's own work per step. Each size runs `--repeats` times and keeps
the run with the lowest median (all runs' medians are printed too). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time

from parkade.schemas import EngineRequest, SamplingParams, StepPlan, StepResult, topics
from parkade.services.scheduler.config import SchedulerConfig
from parkade.services.scheduler.scheduler import Scheduler


def run(size: int, steps: int, prompt_len: int, block_size: int, prefix_caching: bool) -> dict:
    budget = max(8192, size)
    # Early admissions decode while later ones prefill: none may finish before the timed steps end.
    max_tokens = steps + 2 * size * prompt_len // budget + 64
    blocks_per_request = -(-(prompt_len + max_tokens + 8) // block_size)
    config = SchedulerConfig(
        num_blocks=size * blocks_per_request + 8,
        block_size=block_size,
        max_num_seqs=size,
        max_num_batched_tokens=budget,
        max_model_len=prompt_len + max_tokens + 8,
        enable_prefix_caching=prefix_caching,
    )
    scheduler = Scheduler(config)
    rng = random.Random(size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(size):
        prompt = tuple(rng.randrange(4, 8000) for _ in range(prompt_len))
        scheduler.add(EngineRequest(request_id=f"req-{i}", prompt_token_ids=prompt, sampling_params=params))

    in_flight: list[tuple[StepPlan, StepResult]] = []

    def step() -> tuple[StepPlan, StepResult | None, float]:
        """One step, two in flight as the service runs; -> (plan, result, seconds in the scheduler)."""
        placeholders = {r.request_id: r.num_output_placeholders for r in scheduler.running}
        start = time.perf_counter()
        plan = scheduler.schedule()
        elapsed = time.perf_counter() - start
        # As the executor would: a request samples when the step reaches the end of its tokens,
        # which is when the scheduler counts one more token in flight for it.
        sampling = tuple(
            request_id
            for request_id in plan.num_scheduled_tokens
            if scheduler.requests[request_id].num_output_placeholders > placeholders.get(request_id, 0)
        )
        in_flight.append((plan, StepResult(step_id=plan.step_id, request_ids=sampling,
                                           sampled_token_ids=(7,) * len(sampling))))  # fmt: skip
        result = None
        if len(in_flight) == 2:  # the oldest step's result comes back
            oldest, result = in_flight.pop(0)
            start = time.perf_counter()
            scheduler.update(oldest, result)
            elapsed += time.perf_counter() - start
        return plan, result, elapsed

    # Prefill until every request decodes (one token a step).
    while True:
        plan = step()[0]
        if len(plan.num_scheduled_tokens) == size and all(n == 1 for n in plan.num_scheduled_tokens.values()):
            break
    for _ in range(4):
        step()

    gc.collect()
    gc.disable()  # the service runs with gc on, but a collection in the timed loop is noise here
    try:
        times, plans, results = [], [], []
        for _ in range(steps):
            plan, result, elapsed = step()
            times.append(elapsed)
            plans.append(plan)
            results.append(result)
    finally:
        gc.enable()
    short = [(p.step_id, len(p.num_scheduled_tokens)) for p in plans if len(p.num_scheduled_tokens) != size]
    assert not short, f"every request decodes every step: {short[:5]}"
    assert scheduler.num_preemptions == 0

    start = time.perf_counter()
    encoded_plans = [topics.ENCODER.encode(p) for p in plans]
    plan_encode_s = (time.perf_counter() - start) / len(plans)
    start = time.perf_counter()
    encoded_results = [topics.ENCODER.encode(r) for r in results if r is not None]
    result_encode_s = (time.perf_counter() - start) / len(encoded_results)
    median = statistics.median(times)
    return {
        "running": size,
        "step_ms_p50": round(median * 1e3, 3),
        "us_per_request_per_step": round(median / size * 1e6, 3),
        "plan_bytes_mean": round(statistics.fmean(map(len, encoded_plans))),
        "plan_encode_us": round(plan_encode_s * 1e6, 1),
        "result_bytes_mean": round(statistics.fmean(map(len, encoded_results))),
        "result_encode_us": round(result_encode_s * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1024,4096")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs per size; the best median is kept")
    args = parser.parse_args()
    rows = []
    for n in args.sizes.split(","):
        # The best of a few runs: on a shared VM a whole run can be slowed by its neighbours.
        runs = [
            run(int(n), args.steps, args.prompt_len, args.block_size, not args.no_prefix_caching)
            for _ in range(args.repeats)
        ]
        best = min(runs, key=lambda r: r["us_per_request_per_step"])
        best["us_per_request_per_step_all_runs"] = [r["us_per_request_per_step"] for r in runs]
        rows.append(best)
    per_request = [r["us_per_request_per_step"] for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "scheduler_step_cost",
                "settings": vars(args),
                "machine": f"{platform.machine()}, Python {platform.python_version()}",
                "results": rows,
                "us_per_request_per_step_max": max(per_request),
                "growth_largest_over_smallest": round(per_request[-1] / per_request[0], 2),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
