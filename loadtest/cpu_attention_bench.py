"""The CPU paged-attention kernel (`kernels/csrc/paged_attention.c`) on decode and prefill shapes,
against the same kernel at another git revision, in one process. Prints one JSON document.

    python loadtest/cpu_attention_bench.py --against REV [--threads N] [--repeat R]

Each case is a batch of decode rows (one query per request, its context in shuffled blocks of
16) or fresh prompts' prefill rows (one of 512 tokens, or eight of 256 as in a 2,048-token step),
bf16 K/V, at the heads of the anchors' tiny-llama (4 query heads over 2 KV heads of 64),
small-llama (12 over 4 of 64) and an 8B-like layer (32 over 8 of 128). The tiny- and small-llama
decode cases fit a 32 MiB L3 cache and are re-read from it; the "from DRAM" ones attend a pool per
layer in turn, as a server's step does, so that their K/V comes from memory (the time and GB/s are
per call).
Both builds run every case alternately `--repeat` times; the best time of each is reported,
with GB/s of K/V read for the decode cases and the largest difference between the two outputs.
`--against` is any revision whose tree has the kernel source (7642e8a: the per-key loop before the
register-blocked AVX512-BF16 path).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from parkade.kernels import attention_cpu
from parkade.services.executor import cpu_malloc
from parkade.services.executor.cpu_paths import cpu_description

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "kernels/csrc/paged_attention.c"
DECODE = [  # (name, q heads, kv heads, head_dim, batch, context, pools)
    ("tiny-llama decode", 4, 2, 64, 64, 400, 1),
    ("small-llama decode", 12, 4, 64, 64, 400, 1),
    ("8B-like decode", 32, 8, 128, 32, 1000, 1),
    ("tiny-llama decode, batch 4", 4, 2, 64, 4, 64, 1),
    # As in a server: every layer has its own pool, so a step's K/V comes from DRAM, not the caches.
    ("tiny-llama decode from DRAM (16 pools in turn)", 4, 2, 64, 64, 400, 16),
    ("small-llama decode from DRAM (12 pools in turn)", 12, 4, 64, 34, 340, 12),
]
PREFILL = [  # (name, q heads, kv heads, head_dim, prompts, tokens each)
    ("tiny-llama prefill", 4, 2, 64, 1, 512),
    ("small-llama prefill", 12, 4, 64, 1, 512),
    # A 2,048-token prefill step of eight 256-token prompts (a burst's step under `parkade up`).
    ("tiny-llama prefill, 8 x 256", 4, 2, 64, 8, 256),
    ("small-llama prefill, 8 x 256", 12, 4, 64, 8, 256),
]
BLOCK = 16


def _decode_case(q_heads: int, kv_heads: int, head_dim: int, batch: int, context: int, pools: int) -> dict:
    """`pools` > 1: that many K/V pools (layers) attended in turn, the time and bytes per call."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 8
    shape = (num_blocks, BLOCK, kv_heads, head_dim)

    def pool() -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    layers = [(pool(), pool()) for _ in range(pools)]
    table = (
        torch.randperm(num_blocks, generator=gen)[: batch * per_seq].reshape(batch, per_seq).to(torch.int32)
    )
    q = torch.randn(batch, q_heads, head_dim, generator=gen).to(torch.bfloat16)
    lens = [context - (i * 37) % min(50, context) for i in range(batch)]  # ragged, as a live batch
    nbytes = sum(lens) * kv_heads * head_dim * 2 * 2
    scale = head_dim**-0.5

    def run() -> torch.Tensor:
        for k, v in layers:
            out = attention_cpu.decode_attention(q, k, v, table, lens, scale, None)
        return out

    return {"run": run, "bytes": nbytes, "calls": pools}


def _prefill_case(q_heads: int, kv_heads: int, head_dim: int, prompts: int, length: int) -> dict:
    """`prompts` fresh prompts of `length` tokens each, in one call (their blocks in order)."""
    gen = torch.Generator().manual_seed(1)
    per_prompt = -(-length // BLOCK)
    num_blocks = prompts * per_prompt
    k_cache = torch.zeros(num_blocks, BLOCK, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    tokens = prompts * length
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(torch.bfloat16)
    slots = (torch.arange(prompts)[:, None] * per_prompt * BLOCK + torch.arange(length)).flatten()
    attention_cpu.write_kv_cache(k, v, k_cache, v_cache, slots)
    table = torch.arange(num_blocks, dtype=torch.int32).view(prompts, per_prompt)
    cu = torch.arange(prompts + 1, dtype=torch.int32) * length
    used = torch.full((prompts,), length, dtype=torch.int32)

    def run() -> torch.Tensor:
        return attention_cpu.paged_attention_varlen(
            q, k_cache, v_cache, cu_seqlens_q=cu, max_seqlen_q=length, seqused_k=used, max_seqlen_k=length,
            softmax_scale=head_dim**-0.5, block_table=table,
        )  # fmt: skip

    return {"run": run, "bytes": None}


def _use(source: Path) -> None:
    """Build (cached by source) and load the kernel from `source`, and drop the last step's plan.

    NOTE: the plan holds the kernel function of the build it was made with, and a case run again
    with the same lengths reuses it (`attention_cpu._step_plan`): without the reset, every prefill
    case after the first build's ran that build's code, whichever build was asked for."""
    attention_cpu.SOURCE = source
    attention_cpu.library.cache_clear()
    attention_cpu.library()
    attention_cpu._last_plan = None


def _time(fn, seconds: float = 0.3) -> float:
    fn()
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        runs += 1
    return (time.perf_counter() - start) / runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="git revision of the kernel to compare with")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    # The executor's allocator settings (cpu_malloc.py). NOTE: without them a call's output (1-3 MiB
    # here) may come from a fresh mapping, faulted in anew each call, or from the heap, by what the
    # process freed before (glibc raises its mmap threshold as it frees): measured, one build's
    # 8 x 256 prefill ran 1.30 ms a call as the first case of a process, 1.08 after a larger case.
    allocator = cpu_malloc.tune_malloc(os.environ)
    torch.set_num_threads(args.threads)
    old_text = subprocess.run(
        ["git", "show", f"{args.against}:{SOURCE}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        old_source = Path(tmp) / "paged_attention.c"
        old_source.write_text(old_text)
        for name in attention_cpu.HEADERS:  # the headers it includes, at that revision, where it had them
            path = f"{args.against}:{Path(SOURCE).with_name(name)}"
            header = subprocess.run(["git", "show", path], cwd=ROOT, capture_output=True, text=True)
            if header.returncode == 0:
                old_source.with_name(name).write_text(header.stdout)
        builds = {"current": ROOT / SOURCE, args.against: old_source}
        cases = [(name, _decode_case(*shape)) for name, *shape in DECODE]
        cases += [(name, _prefill_case(*shape)) for name, *shape in PREFILL]
        rows = []
        for name, case in cases:
            best = {b: float("inf") for b in builds}
            outputs = {}
            for _ in range(args.repeat):  # alternated: this machine's speed drifts within minutes
                for build, source in builds.items():
                    _use(source)
                    outputs[build] = case["run"]()
                    best[build] = min(best[build], _time(case["run"]) / case.get("calls", 1))
            row = {"case": name, **{f"{b}_ms": round(best[b] * 1e3, 3) for b in builds}}
            row["speedup"] = round(best[args.against] / best["current"], 2)
            if case["bytes"]:
                row["current_gb_per_s"] = round(case["bytes"] / best["current"] / 1e9, 1)
            diff = (outputs["current"].float() - outputs[args.against].float()).abs().max().item()
            row["max_abs_diff"] = diff
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    _use(ROOT / SOURCE)
    print(json.dumps({
        "benchmark": "cpu_attention", "against": args.against, "threads": args.threads,
        "machine": f"{platform.machine()}, python {platform.python_version()}, torch {torch.__version__}",
        "cpu": cpu_description(), "features": attention_cpu.features(), "allocator": allocator, "cases": rows,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
