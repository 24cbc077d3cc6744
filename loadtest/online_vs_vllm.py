"""Online serving side by side: `parkade up` against `vllm serve`, both measured by vLLM's own client.

    python loadtest/online_vs_vllm.py --model /tmp/anchors/models/tiny-llama [--anchors DIR]
        [--vllm-python /tmp/anchors/vllm-venv/bin/python] [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--request-rate inf] [--repeat 1] [--skip vllm|parkade]

One server at a time on this machine: `vllm serve` (every CPU bound, a 2 GiB KV cache), then
`parkade up` (Kafka pipeline and OpenAI gateway, the embedded broker, a 2 GiB KV budget). Each gets
a warm-up round (prompts of another seed: none of them in the timed round), then the timed round of
`bench_serve.py` (the anchors' wrapper of `vllm bench serve`): random prompts of `--input-len`
tokens, `--output-len` tokens out, EOS ignored, all sent at once by default. Prints one JSON
document: for each run (`runs`), each server's output tok/s, TTFT and TPOT (mean, median, p99), the
TTFT's deciles, completed and failed requests, its start-up time (until `/health` says 200), the CPU
seconds each of its processes and the client (with its start-up) used during the timed round
(`cpu_s`: on a small machine the server's processes and the client share the cores, so a pipeline's
own CPU slows its model's steps), and Parkade over vLLM; over the runs, `parkade_over_vllm` (each
ratio's median) and `runs_meeting_goal`: the runs where every request of both servers completed,
Parkade's throughput was at least vLLM's and both its mean TTFT and mean TPOT no worse (the online
goal of the project's issue 26).

`--repeat N` runs the pair N times, each server started fresh, vLLM first in even runs and Parkade
first in odd ones: a VM's speed drifts by more than the difference between the two, so one pair
decides little. A run that fails (a server that never gets ready, a client that errs) is recorded
with its error, and the runs go on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from parkade.services.executor.cpu_paths import cpu_description
from parkade.up import free_port

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ANCHORS = REPO.parent / "shared" / "anchors"
KV_BYTES = 2 * 2**30
# The client's prompts come from its seed (`--dataset-name random`), and one seed gives the same
# first prompts at any --num-prompts: a warm-up of the timed round's seed made its 16 prompts the
# first 16 of the timed round's 64, which both servers' prefix caches (on by default) then served
# (seen 2026-12-07). The warm-up warms the server, not its cache: a seed of its own.
WARMUP_SEED, TIMED_SEED = 0, 1
METRICS = [
    "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "completed", "failed", "duration",
]  # fmt: skip


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    """Poll `url` until it answers 200; -> seconds it took. Raises if the server exits or times out."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s")


def bench(args: argparse.Namespace, port: int, out_dir: Path, name: str, num_prompts: int, seed: int) -> dict:
    """One round of vLLM's client against the server on `port`, its prompts drawn from `seed`;
    -> its result JSON."""
    filename = f"{name}.json"
    command = [
        args.vllm_python, str(args.anchors / "bench_serve.py"), "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", args.model.name, "--tokenizer", str(args.model), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--request-rate", args.request_rate, "--ignore-eos",
        "--seed", str(seed), "--save-result", "--save-detailed", "--result-dir", str(out_dir),
        "--result-filename", filename,
    ]  # fmt: skip
    print("[online_vs_vllm] " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, stdout=sys.stderr)
    return json.loads((out_dir / filename).read_text())


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (both servers shut down cleanly on it), then SIGKILL the group after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_and_bench(args: argparse.Namespace, name: str, command: list[str], env: dict, port: int, tmp: Path):
    log = (tmp / f"{name}.log").open("w")
    print(f"[online_vs_vllm] starting {name}: " + " ".join(command), file=sys.stderr, flush=True)
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # /health, not /v1/models: Parkade's gateway lists the model as soon as it listens, about
        # 18 s before its executor has compiled (measured on tiny-llama); both say 200 on /health
        # only once they can serve.
        ready_s = wait_ready(f"http://127.0.0.1:{port}/health", proc, args.ready_timeout)
        bench(args, port, tmp, f"{name}-warmup", min(16, args.num_prompts), WARMUP_SEED)
        before, client_before = tree_cpu_s(proc.pid), children_cpu_s()
        result = bench(args, port, tmp, name, args.num_prompts, TIMED_SEED)
        after, client_after = tree_cpu_s(proc.pid), children_cpu_s()
    finally:
        stop(proc)
        log.close()
    return {
        "ready_s": round(ready_s, 1),
        **{key: result.get(key) for key in METRICS},
        "ttft_ms_deciles": ttft_deciles_ms(result),
        "cpu_s": {
            **{label: round(after[label] - before.get(label, 0.0), 2) for label in sorted(after)},
            "client": round(client_after - client_before, 2),
        },
    }


def tree_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of process `root` and its live descendants (`parkade up`
    starts each service in a session of its own, so a process group would miss them), summed by
    label (process_label)."""
    ticks = os.sysconf("SC_CLK_TCK")
    processes: dict[int, tuple[int, float, list[str]]] = {}  # pid -> (parent, CPU seconds, argv)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        # The fields after the parenthesised name (which may hold spaces): ppid is the 2nd,
        # utime and stime the 12th and 13th.
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        processes[int(entry.name)] = (int(fields[1]), cpu, [a.decode(errors="replace") for a in argv if a])
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    totals: dict[str, float] = {}
    todo = [root] if root in processes else []
    while todo:
        pid = todo.pop()
        _, cpu, argv = processes[pid]
        label = process_label(argv)
        totals[label] = totals.get(label, 0.0) + cpu
        todo.extend(children.get(pid, []))
    return totals


def process_label(argv: list[str]) -> str:
    """A process's label by its command line: `python -m parkade.cli executor ...` -> "executor",
    `python -m vllm.entrypoints...` -> the module, `.../parkade up` -> "parkade up", else the
    program's name up to its first "-" (`tansu-v0.6.0-...` -> "tansu")."""
    if "-m" in argv[:-1]:
        module = argv[argv.index("-m") + 1 :]
        return module[1] if module[0] == "parkade.cli" and len(module) > 1 else module[0]
    if len(argv) > 2 and Path(argv[1]).name == "parkade":
        return f"parkade {argv[2]}"
    return Path(argv[0]).name.split("-")[0] if argv else "?"


def children_cpu_s() -> float:
    """CPU seconds of this process's waited-for children (the client is one)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ttft_deciles_ms(result: dict) -> list[float]:
    """The completed requests' TTFT at the 0th, 10th, ..., 100th percentile (nearest rank), in ms,
    from the client's detailed result: where two means differ, whether the first tokens came
    later from the start (ingestion) or drifted apart step by step (the prefill's pace)."""
    ttfts, errors = result.get("ttfts") or [], list(result.get("errors") or [])
    errors += [""] * (len(ttfts) - len(errors))  # (a diagnostic: never fail a run over it)
    ttfts = sorted(t for t, error in zip(ttfts, errors, strict=False) if not error)
    if not ttfts:
        return []
    return [round(1000 * ttfts[int(q * (len(ttfts) - 1) / 10 + 0.5)], 1) for q in range(11)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--anchors", type=Path, default=DEFAULT_ANCHORS)
    parser.add_argument("--vllm-python", default="/tmp/anchors/vllm-venv/bin/python")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--repeat", type=int, default=1, help="pairs of runs, alternated")
    parser.add_argument("--skip", default="", help="vllm or parkade")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    args.model, args.anchors = args.model.resolve(), args.anchors.resolve()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    runs: list[dict] = []
    for run in range(args.repeat):
        order = ["vllm", "parkade"] if run % 2 == 0 else ["parkade", "vllm"]
        try:
            results = run_pair(args, [name for name in order if name not in skip])
        except Exception as error:  # the runs so far still count
            print(f"[online_vs_vllm] run {run} failed: {error!r}", file=sys.stderr, flush=True)
            runs.append({"order": order, "error": repr(error)})
            continue
        ratios = ratios_of(results)
        shown = {key: round(value, 3) for key, value in ratios.items()}
        runs.append({"order": order, "results": results, "parkade_over_vllm": shown})
    summary = {
        "benchmark": "online_vs_vllm",
        "model": args.model.name,
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "request_rate": args.request_rate,
        },
        "cpu": cpu_description(),
        **summarize([run["results"] for run in runs if "results" in run], args.num_prompts),
        "runs": runs,
    }
    print(json.dumps(summary, indent=2))


def summarize(runs: list[dict[str, dict]], num_prompts: int) -> dict:
    """Over the runs that had both servers: each ratio's median (throughput: higher is better;
    TTFT and TPOT: lower is better), and in how many runs the goal held (see the module)."""
    paired = [(results, ratios) for results in runs if (ratios := ratios_of(results))]
    medians = (
        {key: round(statistics.median(r[key] for _, r in paired), 3) for key in paired[0][1]}
        if paired
        else {}
    )
    meeting = sum(
        results["vllm"]["completed"] == results["parkade"]["completed"] == num_prompts
        and r["output_throughput"] >= 1
        and r["mean_ttft"] <= 1
        and r["mean_tpot"] <= 1
        for results, r in paired
    )
    return {"parkade_over_vllm": medians, "runs_meeting_goal": meeting}


def ratios_of(results: dict[str, dict]) -> dict[str, float]:
    """Parkade over vLLM, unrounded: {} unless both ran."""
    if "vllm" not in results or "parkade" not in results:
        return {}
    p, v = results["parkade"], results["vllm"]
    return {
        "output_throughput": p["output_throughput"] / v["output_throughput"],
        "mean_ttft": p["mean_ttft_ms"] / v["mean_ttft_ms"],
        "mean_tpot": p["mean_tpot_ms"] / v["mean_tpot_ms"],
    }


def run_pair(args: argparse.Namespace, order: list[str]) -> dict[str, dict]:
    """One run of each server in `order`, each started fresh."""
    results: dict[str, dict] = {}
    for name in order:
        results[name] = (run_vllm if name == "vllm" else run_parkade)(args)
    return results


def run_vllm(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name:
        port = free_port()
        cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))  # bind every CPU, as the anchor
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_BYTES // 2**30)}
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        command = [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--port", str(port), "--served-model-name", args.model.name,
        ]  # fmt: skip
        return serve_and_bench(args, "vllm", command, env, port, Path(tmp_name))


def run_parkade(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        env = {**os.environ, "PARKADE_HOME": os.environ.get("PARKADE_HOME", str(tmp / "parkade-home"))}
        command = [
            str(Path(sys.executable).with_name("parkade")), "up", "--model", str(args.model),
            "--http-port", str(port), "--kv-cache-memory-bytes", str(KV_BYTES),
        ]  # fmt: skip
        return serve_and_bench(args, "parkade", command, env, port, tmp)


if __name__ == "__main__":
    main()
