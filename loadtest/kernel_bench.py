"""Decode attention bandwidth: the Triton paged kernel against the GPU's peak and torch SDPA.

    python loadtest/kernel_bench.py [--batch-sizes 1,4,16,64,256] [--contexts 512,2048,8192,32768]
                                    [--peak-gbps GBPS] [--dry-run] [--launch-sweep]

A decode step reads every cached key and value once and does little arithmetic with them, so its
speed is memory bandwidth: achieved GB/s = K/V bytes read / kernel time. Each case is `batch`
requests with `context` tokens each and one query per request, Llama-8B-like heads (32 query heads
over 8 KV heads of 128, bf16), its K/V in shuffled blocks of 16. SDPA (`enable_gqa`) gets the same
K/V contiguous, `[batch, kv_heads, context, head_dim]`: what a dense kernel reaches without paging.
Before timing, one case per context length is checked against SDPA (max abs error). Cases whose
K/V do not fit in free memory are reported as skipped. Prints one JSON document.

--launch-sweep instead times the kernel under every num_warps x num_stages x key-tile launch for
head sizes 64, 128 and 256, next to the launch `choose_launch` picks (what tunes that choice).

--dry-run runs the same flow on the CPU through the Triton interpreter with a tiny shape and a
time.perf_counter timer: a smoke test of the script, its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def as_dict(self) -> dict:
        return {
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


class Case(NamedTuple):
    batch: int
    context: int


LLAMA_8B = Shape(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
TINY = Shape(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32)
BATCH_SIZES = (1, 4, 16, 64, 256)
CONTEXTS = (512, 2048, 8192, 32768)
DRY_RUN_BATCH_SIZES = (2,)
DRY_RUN_CONTEXTS = (64,)
# Spec-sheet HBM bandwidth, GB/s; the first row whose words all occur in the device name wins.
PEAK_GBPS = (
    (("H200",), 4800.0),
    (("H100", "PCIe"), 2000.0),
    (("H100",), 3350.0),  # SXM: "NVIDIA H100 80GB HBM3"
    (("A100", "80GB", "PCIe"), 1935.0),
    (("A100", "80GB"), 2039.0),  # SXM: "NVIDIA A100-SXM4-80GB"
)
MEMORY_HEADROOM = 0.9  # of free memory a case may plan to use


# --- pure: what to run and how to report it ---------------------------------------------------------


def make_cases(batch_sizes: Iterable[int], contexts: Iterable[int]) -> list[Case]:
    """Every (batch, context) pair, by context then batch: the first case of each context is its
    smallest batch, the one checked for correctness."""
    return [Case(b, c) for c in sorted(set(contexts)) for b in sorted(set(batch_sizes))]


def kv_bytes(case: Case, shape: Shape) -> int:
    """Bytes of K and V one decode step reads: every cached token's key and value, every KV head."""
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    return 2 * case.batch * case.context * shape.num_kv_heads * shape.head_dim * itemsize


def required_bytes(case: Case, shape: Shape) -> int:
    """Memory a case holds at once: the paged pool (whole blocks), the contiguous copy for SDPA,
    queries and both outputs, and the split-K partial results (at most 32 splits, fp32)."""
    itemsize = torch.empty((), dtype=shape.dtype).element_size()
    blocks = math.ceil(case.context / shape.block_size)
    pool = 2 * case.batch * blocks * shape.block_size * shape.num_kv_heads * shape.head_dim * itemsize
    rows = case.batch * shape.num_q_heads
    partials = rows * 32 * (max(16, shape.head_dim) + 2) * 4
    return pool + kv_bytes(case, shape) + 3 * rows * shape.head_dim * itemsize + partials


def fits(required: int, free: int, headroom: float = MEMORY_HEADROOM) -> bool:
    return required <= free * headroom


def peak_gbps_for(device_name: str) -> float | None:
    for words, gbps in PEAK_GBPS:
        if all(word in device_name for word in words):
            return gbps
    return None


def gbps(num_bytes: int, seconds: float | None) -> float | None:
    return None if seconds is None else num_bytes / seconds / 1e9


def _sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits (the dry run's GB/s are tiny, a GPU's are thousands)."""
    return float(f"{x:.{digits}g}")


def case_record(
    case: Case,
    shape: Shape,
    *,
    triton_s: float,
    sdpa_s: float | None,
    peak_gbps: float | None,
    num_splits: int | None = None,
    max_abs_err: float | None = None,
) -> dict:
    """One measured case; sdpa_s None: SDPA failed (e.g. out of memory); max_abs_err None: unchecked."""
    num_bytes = kv_bytes(case, shape)
    triton_gbps, sdpa_gbps = gbps(num_bytes, triton_s), gbps(num_bytes, sdpa_s)

    def frac(x: float | None) -> float | None:
        return None if x is None or not peak_gbps else _sig(x / peak_gbps)

    record = {"batch": case.batch, "context": case.context, "kv_bytes": num_bytes}
    if num_splits is not None:
        record["num_splits"] = num_splits
    record |= {
        "triton_ms": _sig(triton_s * 1e3),
        "triton_GBps": _sig(triton_gbps),
        "triton_frac_peak": frac(triton_gbps),
        "sdpa_ms": None if sdpa_s is None else _sig(sdpa_s * 1e3),
        "sdpa_GBps": None if sdpa_gbps is None else _sig(sdpa_gbps),
        "sdpa_frac_peak": frac(sdpa_gbps),
        "max_abs_err": max_abs_err,
    }
    return record


def skipped_record(case: Case, shape: Shape, reason: str) -> dict:
    return {
        "batch": case.batch,
        "context": case.context,
        "kv_bytes": kv_bytes(case, shape),
        "required_bytes": required_bytes(case, shape),
        "reason": reason,
    }


def report(
    *, device: str, peak_gbps: float | None, shape: Shape, timer: str, dry_run: bool, records: list[dict]
) -> dict:
    """The JSON document: measured cases under `cases`, the others (with a reason) under `skipped`."""
    errors = [r["max_abs_err"] for r in records if r.get("max_abs_err") is not None]
    return {
        "benchmark": "decode_attention_bandwidth",
        "dry_run": dry_run,
        "device": device,
        "peak_gbps": peak_gbps,
        "shape": shape.as_dict(),
        "timer": timer,
        "max_abs_err": max(errors) if errors else None,
        "cases": [r for r in records if "reason" not in r],
        "skipped": [r for r in records if "reason" in r],
    }


# --- impure: tensors, kernels, clocks ---------------------------------------------------------------


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def build_inputs(case: Case, shape: Shape, device: torch.device) -> dict[str, torch.Tensor]:
    """A random pool in shuffled blocks, its block table, and the same K/V made contiguous."""
    batch, context = case
    blocks = math.ceil(context / shape.block_size)
    pool_shape = (batch * blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(pool_shape, dtype=shape.dtype, device=device)
    v_cache = torch.randn(pool_shape, dtype=shape.dtype, device=device)
    block_table = torch.randperm(batch * blocks, device=device).view(batch, blocks).int()
    dense_shape = (batch, shape.num_kv_heads, context, shape.head_dim)
    k_dense = torch.empty(dense_shape, dtype=shape.dtype, device=device)
    v_dense = torch.empty(dense_shape, dtype=shape.dtype, device=device)
    # Gather a few sequences at a time: the gathered copy is a temporary as large as its K/V.
    per_seq = kv_bytes(Case(1, context), shape)
    step = max(1, (1 << 30) // per_seq)
    for start in range(0, batch, step):
        rows = block_table[start : start + step].long()
        for cache, dense in ((k_cache, k_dense), (v_cache, v_dense)):
            gathered = cache[rows].flatten(1, 2)[:, :context]  # [n, context, kv_heads, head_dim]
            dense[start : start + step] = gathered.transpose(1, 2)
    return {
        "q": torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=device),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_table": block_table,
        "cu_seqlens_q": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seqused_k": torch.full((batch,), context, dtype=torch.int32, device=device),
        "k_dense": k_dense,
        "v_dense": v_dense,
    }


def cpu_timer(fn: Callable[[], object], warmup: int = 1, reps: int = 3) -> float:
    """Median seconds of `reps` calls after `warmup` ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median seconds under triton's do_bench (warm-up, L2 flushed between runs, CUDA events)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def run_case(
    case: Case,
    shape: Shape,
    device: torch.device,
    timer: Callable[[Callable[[], object]], float],
    attention: ModuleType,
    check: bool,
    launches: Iterable[object] = (),
) -> dict:
    """Time one case (its inputs live only in here): `triton_s`, `sdpa_s` (None if SDPA ran out of
    memory) and `max_abs_err` (None unless `check`) for `case_record`. With `launches` (the
    kernel's `LaunchConfig`s), `sweep` instead: each launch's time and error."""
    x = build_inputs(case, shape, device)
    scale = shape.head_dim**-0.5

    def triton_fn(**launch: object) -> torch.Tensor:
        return attention.paged_attention_varlen(
            x["q"], x["k_cache"], x["v_cache"], cu_seqlens_q=x["cu_seqlens_q"], max_seqlen_q=1,
            seqused_k=x["seqused_k"], max_seqlen_k=case.context, softmax_scale=scale,
            block_table=x["block_table"], query_lens=(1,) * case.batch, seq_lens=(case.context,) * case.batch,
            **launch,
        )  # fmt: skip

    q_dense = x["q"].unsqueeze(2)  # [batch, num_q_heads, 1, head_dim]

    def sdpa_fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_dense, x["k_dense"], x["v_dense"], scale=scale, enable_gqa=True
        )

    if launches:
        expected = triton_fn().float()
        sweep = []
        for launch in launches:
            err = (triton_fn(launch=launch).float() - expected).abs().max().item()
            seconds = timer(lambda launch=launch: triton_fn(launch=launch))
            sweep.append({**dataclasses.asdict(launch), "ms": _sig(seconds * 1e3), "max_abs_diff": err})
        return {"sweep": sweep, "default_ms": _sig(timer(triton_fn) * 1e3)}
    result: dict = {"max_abs_err": None, "sdpa_s": None}
    if check:
        expected = sdpa_fn().squeeze(2).float()
        result["max_abs_err"] = (triton_fn().float() - expected).abs().max().item()
    result["triton_s"] = timer(triton_fn)
    with contextlib.suppress(torch.OutOfMemoryError):  # e.g. a backend that expands KV heads for GQA
        result["sdpa_s"] = timer(sdpa_fn)
    return result


def bench(args: argparse.Namespace) -> dict:
    device = torch.device("cpu" if args.dry_run else "cuda")
    from parkade.kernels import attention_triton  # after TRITON_INTERPRET is settled (main)

    shape = TINY if args.dry_run else LLAMA_8B
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    peak = args.peak_gbps if args.peak_gbps is not None else peak_gbps_for(name)
    timer = cpu_timer if args.dry_run else cuda_timer
    choose_splits = getattr(attention_triton, "choose_num_splits", None)
    torch.manual_seed(args.seed)
    records, checked = [], set()
    for case in make_cases(args.batch_sizes, args.contexts):
        free = free_memory_bytes(device)
        if not fits(required_bytes(case, shape), free):
            reason = f"needs more than {MEMORY_HEADROOM:.0%} of free memory"
            records.append(skipped_record(case, shape, reason))
            continue
        try:
            m = run_case(case, shape, device, timer, attention_triton, check=case.context not in checked)
        except torch.OutOfMemoryError:
            records.append(skipped_record(case, shape, "out of memory"))
        else:
            checked.add(case.context)
            splits = choose_splits(case.batch, shape.num_kv_heads, 1, case.context) if choose_splits else None
            records.append(case_record(case, shape, peak_gbps=peak, num_splits=splits, **m))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    timer_name = "time.perf_counter median of 3" if args.dry_run else "triton.testing.do_bench median"
    return report(
        device=name, peak_gbps=peak, shape=shape, timer=timer_name, dry_run=args.dry_run, records=records
    )


# Launch sweep (--launch-sweep): decode attention of these head sizes (query / KV heads as in models
# that use them), on a few cases, over every listed warps x stages x key tile.
SWEEP_SHAPES = (
    Shape(num_q_heads=32, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16),
    LLAMA_8B,
    Shape(num_q_heads=16, num_kv_heads=8, head_dim=256, block_size=16, dtype=torch.bfloat16),
)
SWEEP_CASES = (Case(64, 2048), Case(8, 32768))
SWEEP_WARPS, SWEEP_STAGES = (2, 4, 8), (1, 2, 3, 4)


def sweep(args: argparse.Namespace) -> dict:
    """Time every launch configuration per head size against the launcher's own choice."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    from parkade.kernels import attention_triton

    timer = cpu_timer if args.dry_run else cuda_timer
    shapes = (TINY,) if args.dry_run else SWEEP_SHAPES
    cases = (Case(2, 64),) if args.dry_run else SWEEP_CASES
    warps, stages = ((4,), (1, 2)) if args.dry_run else (SWEEP_WARPS, SWEEP_STAGES)
    rows = []
    for shape in shapes:
        chosen = attention_triton.choose_launch(shape.head_dim, shape.num_q_heads // shape.num_kv_heads, 1)
        tiles = sorted({chosen.block_n, max(16, chosen.block_n // 2)})
        launches = [
            attention_triton.LaunchConfig(chosen.block_q, n, num_warps=w, num_stages=st)
            for n, w, st in itertools.product(tiles, warps, stages)
        ]
        for case in cases:
            if not fits(required_bytes(case, shape), free_memory_bytes(device)):
                continue
            m = run_case(case, shape, device, timer, attention_triton, check=False, launches=launches)
            best = min(m["sweep"], key=lambda r: r["ms"])
            rows.append({
                "shape": shape.as_dict(), "batch": case.batch, "context": case.context,
                "chosen": dataclasses.asdict(chosen), "chosen_ms": m["default_ms"], "best": best,
                "chosen_over_best": _sig(m["default_ms"] / best["ms"]), "all": m["sweep"],
            })  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    return {"benchmark": "triton_launch_sweep", "device": name, "dry_run": args.dry_run, "results": rows}


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", type=parse_ints, default=None, help="comma-separated")
    parser.add_argument("--contexts", type=parse_ints, default=None, help="comma-separated")
    parser.add_argument("--peak-gbps", type=float, default=None, help="default: by device name")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="tiny shape on the CPU (Triton interpreter)")
    parser.add_argument(
        "--launch-sweep", action="store_true", help="time each warps/stages/tile launch per head size"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        # NOTE: CPU tensors need the interpreter even where CUDA exists; it is read when triton is
        # first imported, which happens only in bench().
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("kernel_bench.py: no CUDA device; run it on a GPU, or pass --dry-run.", file=sys.stderr)
        return 2
    if args.batch_sizes is None:
        args.batch_sizes = DRY_RUN_BATCH_SIZES if args.dry_run else BATCH_SIZES
    if args.contexts is None:
        args.contexts = DRY_RUN_CONTEXTS if args.dry_run else CONTEXTS
    print(json.dumps(sweep(args) if args.launch_sweep else bench(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
