"""Offline throughput and KV utilization: paged admission vs `reserve`, on the same KV budget.

    python loadtest/offline_bench.py [--model DIR] [--num-requests 192] [--kv-tokens 8192] ...

Each request asks for up to `--max-tokens` tokens (the cap a client sends), but stories end at
EOS after widely varying lengths, as real completions do. `reserve` admission holds slots for
prompt + max_tokens from admission on, as servers without paging do; `paged` takes one block at a
time. Both runs get the same requests (same prompts, same seeds) and the same KV pool.

KV utilization = live tokens (KV actually stored for running requests) / allocated slots
(used blocks * block_size), sampled after every scheduling step. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from parkade.engine.args import EngineArgs
from parkade.engine.engine import Engine
from parkade.models import DEFAULT_MODEL
from parkade.schemas import SamplingParams, StepPlan
from parkade.services.common.model_config import ModelConfig
from parkade.services.executor.kv_pool import bytes_per_block
from parkade.services.scheduler.config import AdmissionMode

STORIES = DEFAULT_MODEL  # the trained stories260K that ships with Parkade
OPENINGS = [
    "Once upon a time",
    "Lily and Tom went to the park",
    "The little dog",
    "One day, a girl named Sue",
    "Tim had a big red ball",
    "There was a cat who liked to",
    "Mom said",
    "In a small house there lived",
]


def make_workload(n: int, seed: int, max_tokens: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            rng.choice(OPENINGS),
            SamplingParams(temperature=0.8, seed=rng.randrange(2**31), max_tokens=max_tokens),
        )
        for _ in range(n)
    ]


def run(args: argparse.Namespace, admission: AdmissionMode) -> dict:
    config = ModelConfig.from_pretrained(args.model, args.dtype)
    kv_bytes = (args.kv_tokens // args.block_size) * bytes_per_block(config, args.block_size, config.dtype)
    engine = Engine(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=kv_bytes,
            admission=admission,
            seed=0,
        )
    )
    scheduler = engine.core.scheduler
    samples: list[tuple[float, int, int]] = []  # (kv utilization, running, tokens in step)

    def record(plan: StepPlan) -> None:
        stats = scheduler.stats()
        if stats.num_allocated_slots:
            samples.append((stats.kv_utilization, stats.num_running, plan.total_num_scheduled_tokens))

    engine.core.on_schedule = record
    workload = make_workload(args.num_requests, args.seed, args.max_tokens)
    start = time.perf_counter()
    for i, (prompt, params) in enumerate(workload):
        engine.add_request(str(i), prompt, params)
    lengths: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                lengths[output.request_id] = len(output.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    output_tokens = sum(lengths.values())
    utilization = [u for u, _, _ in samples]
    return {
        "admission": admission,
        "num_blocks": scheduler.kv.num_blocks,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "steps": len(samples),
        "kv_utilization_mean": round(statistics.fmean(utilization), 4),
        "kv_utilization_p50": round(statistics.median(utilization), 4),
        "running_seqs_mean": round(statistics.fmean(r for _, r, _ in samples), 2),
        "preemptions": scheduler.num_preemptions,
        "output_len_min": min(lengths.values()),
        "output_len_median": statistics.median(lengths.values()),
        "output_len_max": max(lengths.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(STORIES))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--max-tokens", type=int, default=448)
    parser.add_argument("--kv-tokens", type=int, default=8192, help="KV budget, in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {mode.value: run(args, mode) for mode in AdmissionMode}
    paged, reserve = results["paged"], results["reserve"]
    ratio = paged["output_tokens_per_s"] / reserve["output_tokens_per_s"]
    machine = f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    print(
        json.dumps(
            {
                "benchmark": "offline_paged_vs_reserve",
                "model": Path(args.model).name if args.model != str(STORIES) else "stories260K",
                "settings": {k: v for k, v in vars(args).items() if k != "model"},
                "machine": machine,
                "results": results,
                "throughput_ratio_paged_over_reserve": round(ratio, 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
