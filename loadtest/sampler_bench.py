"""The executor's sampler on a decode batch's logits (CPU). Prints one JSON document.

    python loadtest/sampler_bench.py [--rows 64] [--vocab 8192] [--threads N] [--repeat 200]

Cases, each the median time of one call over `--repeat` calls:
  - `temperature`: every row samples at temperature 1 with nothing else in force, as under vLLM's
    `bench serve` client (the race reads the raw logits in one C pass, `kernels/csrc/race.c`);
  - `top_p`: every row with top_p 0.9 (the rules run in torch, a full sort of each row, then the
    same race); `top_k`: every row with top_k 50 (torch's topk, no sort);
  - `greedy`: the greedy fast path (the raw argmax);
  - `race_c` / `race_torch`: the race alone, the C pass and its torch twin (what GPUs and builds
    without a C compiler run);
  - `torch_uniform`: torch's own generator filling the [rows, vocab] uniforms the race needs
    (the noise the sampler drew before the C pass; for comparison only).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parkade.kernels import attention_cpu
from parkade.kernels.race import race, race_torch
from parkade.schemas import SamplingParams
from parkade.services.executor.cpu_paths import cpu_description
from parkade.services.executor.sampler import Sampler


@dataclass
class Row:
    sampling_params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...] = (2,)


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    context = list(range(300))

    def rows(**params: object) -> list[Row]:
        return [Row(SamplingParams(max_tokens=16, **params), context, 256) for _ in range(args.rows)]

    sampler, generator = Sampler(), torch.Generator().manual_seed(1)
    rng = random.Random(2)
    keys = [rng.getrandbits(64) for _ in range(args.rows)]
    ones = [1.0] * args.rows
    noise = torch.empty_like(logits)
    cases = {
        "temperature": lambda: sampler(logits, rows(temperature=1.0), generator),
        "top_p": lambda: sampler(logits, rows(temperature=1.0, top_p=0.9), generator),
        "top_k": lambda: sampler(logits, rows(temperature=1.0, top_k=50), generator),
        "greedy": lambda: sampler(logits, rows(temperature=0.0), generator),
        "race_c": lambda: race(logits, ones, keys),
        "race_torch": lambda: race_torch(logits, ones, keys),
        "torch_uniform": lambda: noise.uniform_(generator=generator),
    }
    result = {
        "benchmark": "sampler",
        "cpu": cpu_description(),
        "features": attention_cpu.features() if attention_cpu.available() else [],
        "threads": args.threads,
        "rows": args.rows,
        "vocab": args.vocab,
        "ms_per_call": {name: median_ms(fn, args.repeat) for name, fn in cases.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
