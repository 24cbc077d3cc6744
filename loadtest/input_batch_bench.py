"""The executor's host-side cost of building one decode step's inputs, by batch size.

    python loadtest/input_batch_bench.py [--sizes 64,256,1024] [--context 1000] [--before REV]

Each size N is a decode step of N requests with `--context` known tokens each (blocks of 16):
the time of `InputBatch.build` (token ids, positions, slot mapping, block table and lengths, CPU
tensors), median of 30. `--before REV` also times that commit's `services/executor/input_batch.py`
(read with `git show`) on the same step, if it has `build_inputs` (the per-request builder before
the persistent buffers), and checks that both give the same tensors. One torch thread. Prints JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from parkade.schemas import NewRequestData, SamplingParams, StepPlan
from parkade.services.executor.input_batch import InputBatch

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 16


def load_before(rev: str):
    source = subprocess.run(
        ["git", "show", f"{rev}:services/executor/input_batch.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "input_batch_before.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("input_batch_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "build_inputs"):
        raise SystemExit(f"{rev} has no build_inputs to compare with")
    return module


def median_ms(fn) -> float:
    times = []
    for _ in range(30):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def run(size: int, context: int, before) -> dict:
    rng = random.Random(size)
    blocks = -(-(context + 1) // BLOCK_SIZE)
    requests = [
        NewRequestData(
            request_id=f"r{i}",
            token_ids=tuple(rng.randrange(32000) for _ in range(context)),
            num_prompt_tokens=context,
            sampling_params=SamplingParams(),
            block_ids=tuple(range(i * blocks, (i + 1) * blocks)),
            num_computed_tokens=context - 1,  # its last token is this step's query
        )
        for i in range(size)
    ]
    plan = StepPlan(step_id=1, num_scheduled_tokens={r.request_id: 1 for r in requests})
    batch = InputBatch(BLOCK_SIZE, torch.device("cpu"))
    for r in requests:
        batch.add(r)
    row = {"decodes": size, "context": context, "build_ms": median_ms(lambda: batch.build(plan))}
    if before is not None:
        states = {r.request_id: before.CachedRequestState.from_new(r) for r in requests}
        old = before.build_inputs(plan, states, BLOCK_SIZE, torch.device("cpu"))
        new = batch.build(plan)
        for name in ("input_ids", "positions", "logits_indices"):
            assert torch.equal(getattr(old, name), getattr(new, name)), name
        for name in ("slot_mapping", "block_table", "seqused_k", "cu_seqlens_q"):
            assert torch.equal(getattr(old.attn_metadata, name), getattr(new.attn_metadata, name)), name
        cpu = torch.device("cpu")
        row["before_ms"] = median_ms(lambda: before.build_inputs(plan, states, BLOCK_SIZE, cpu))
        row["speedup"] = round(row["before_ms"] / row["build_ms"], 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,256,1024")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--before", help="a git revision whose input builder to time as well")
    args = parser.parse_args()
    torch.set_num_threads(1)
    before = load_before(args.before) if args.before else None
    rows = [run(int(n), args.context, before) for n in args.sizes.split(",")]
    doc = {
        "benchmark": "input_batch_build",
        "settings": vars(args),
        "machine": f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}",
        "results": rows,
    }
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
