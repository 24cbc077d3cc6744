"""KV blocks held by parallel sampling: one request with n samples vs n requests that cannot share.

    python loadtest/parallel_sampling_bench.py [--model DIR] [--prompt-tokens 384] [--max-tokens 64]
                                               [--n 1 2 4 8] [--block-size 16]

For each n, the same prompt runs (a) as one request with `SamplingParams(n=n)`, whose samples
hold the prompt's full blocks once, and (b) as n requests with n different `cache_salt`s, which
share nothing: the KV a server without block sharing holds. Both runs sample with the same seeds
and ignore EOS, so they generate the same number of tokens. Reported per n: the most blocks in
use at once, prompt tokens computed, and wall time. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import UTC, datetime
from pathlib import Path

from parkade import LLM, SamplingParams
from parkade.models import DEFAULT_MODEL
from parkade.services.scheduler.kv_cache_manager import cdiv


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict:
    """Run `prompts` to completion one engine step at a time -> peak blocks, computed prompt tokens."""
    engine = llm.engine
    scheduler = engine.core.scheduler
    computed = 0

    def count(plan) -> None:
        nonlocal computed
        for new in plan.new_requests:
            computed += len(new.token_ids) - new.num_computed_tokens

    engine.core.on_schedule = count
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, scheduler.kv.pool.num_used_blocks)
    engine.core.on_schedule = None
    return {
        "peak_blocks": peak,
        "computed_prompt_tokens": computed,
        "seconds": round(time.perf_counter() - start, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--prompt-tokens", type=int, default=384)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()

    llm = LLM(model=args.model, dtype="float32", block_size=args.block_size, seed=0)
    vocab = llm.engine.frontend.vocab_size
    results = []
    for round_, n in enumerate(args.n):
        # A fresh prompt each round, so that no round finds another's blocks in the cache.
        prompt = [3 + (round_ * 7919 + i * 31) % (vocab - 3) for i in range(args.prompt_tokens)]
        samples = SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
        shared = run(llm, [{"prompt_token_ids": prompt}], samples)
        single = SamplingParams(temperature=1.0, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
        salted = [{"prompt_token_ids": prompt, "cache_salt": f"r{round_}-s{i}"} for i in range(n)]
        independent = run(llm, salted, single)
        # The samples share the prompt's full blocks but for the one holding its last token, which
        # each computes itself (a step needs that token's hidden state to sample from).
        shared_blocks = (args.prompt_tokens - 1) // args.block_size
        tail = args.prompt_tokens - shared_blocks * args.block_size
        results.append(
            {
                "n": n,
                "n_samples": shared,
                "n_salted_requests": independent,
                # One prompt's shared blocks, and each sample's tail + output.
                "ideal_blocks": shared_blocks + n * cdiv(tail + args.max_tokens, args.block_size),
                "block_ratio": round(independent["peak_blocks"] / shared["peak_blocks"], 2),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "parallel_sampling_bench",
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "model": str(args.model),
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "block_size": args.block_size,
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine(),
                },
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
