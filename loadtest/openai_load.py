"""Load generator for OpenAI-compatible servers (vLLM, Parkade's gateway): latency under offered load.

    python loadtest/openai_load.py --base-url http://127.0.0.1:8000/v1 [--endpoint completions|chat]
        [--model NAME] [--api-key KEY] [--num-requests 64] [--request-rate R | --rates 1,2,4,inf]
        [--arrival poisson|fixed] [--max-concurrency N] [--max-tokens 32] [--prompts FILE]
        [--temperature 0] [--ignore-eos] [--seed N] [--timeout 300] [--out FILE] [--plot FILE] [--no-progress]

Every request streams (`stream_options.include_usage`); its SSE lines are parsed as they arrive. Times
are time.perf_counter() on this machine, counted from the request's *send time*: after its scheduled
arrival and after it got a --max-concurrency slot (waiting for a slot is not counted, as in vLLM's
benchmark_serving), just before the HTTP request is issued.
- TTFT: the first chunk carrying non-empty text (`choices[0].text`, or `choices[0].delta.content` for
  chat) minus send time.
- ITL: the gaps between successive chunks carrying non-empty text. A server that puts several tokens in
  one chunk shows fewer, longer gaps: this is per chunk, not per token.
- e2e: `data: [DONE]` received minus send time.
- output tokens: `usage.completion_tokens` of the usage chunk, else the number of content chunks.
A request fails on a non-200 status, an `error` object in the stream, a stream that ends without
[DONE], any exception, or taking more than --timeout seconds in all. Failures are counted and the first
few distinct errors reported; latency statistics are over successful requests only.

Per rate, arrivals are Poisson (exponential gaps of mean 1/rate seeded by --seed, first at t=0) or evenly
spaced; rate inf sends all at once. duration_s runs from the first arrival to the end of the last request;
request_throughput = completed / duration_s; output_throughput_tok_s = output tokens of completed
requests / duration_s. Prints one JSON document; exits 1 if any request failed, 2 if no model was given
and none could be listed from GET /models.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from tqdm import tqdm

DEFAULT_PROMPTS = [
    "Once upon a time",
    "Lily and Tom",
    "The big dog",
    "One day, a girl",
    "Tim had a ball",
    "Mom said",
]
MAX_ERRORS = 5  # distinct error messages kept per run; the counts are always complete


class SetupError(RuntimeError):
    """The run cannot start (no model given and none listed)."""


def arrival_times(n: int, rate: float, kind: str = "poisson", seed: int = 0) -> list[float]:
    """Offsets in seconds from the start of a run at which each of n requests arrives."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    if kind == "fixed":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"unknown arrival kind {kind!r}")
    rng = random.Random(seed)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(n - 1)), initial=0.0))[:n]


def build_request(
    endpoint: str,
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    ignore_eos: bool = False,
) -> tuple[str, dict]:
    """(path under the base URL, JSON body) of one streaming request."""
    common: dict = {"temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if seed is not None:
        common["seed"] = seed
    if ignore_eos:
        common["ignore_eos"] = True  # vLLM's extension; strict OpenAI servers reject unknown fields
    if endpoint == "chat":
        return "/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_completion_tokens": max_tokens,
            **common,
        }
    return "/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, **common}


@dataclass
class RequestResult:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    content_chunks: int = 0
    last_content: float | None = None
    done: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.done and self.error is None


def feed_line(res: RequestResult, endpoint: str, line: str, elapsed: float) -> None:
    """Account for one SSE line received `elapsed` seconds after send. Raises on malformed JSON."""
    if res.done or not line.startswith("data:"):
        return  # blank separators, ":" comments and event/id fields carry nothing measured here
    payload = line[5:].strip()
    if payload == "[DONE]":
        res.done, res.e2e = True, elapsed
        if res.output_tokens is None:
            res.output_tokens = res.content_chunks
        return
    chunk = json.loads(payload)
    if chunk.get("error"):
        # vLLM reports failures that happen after the 200 header as an error object in the stream.
        res.error = res.error or f"stream error: {json.dumps(chunk['error'])[:300]}"
        return
    choices = chunk.get("choices") or []
    if choices:
        first = choices[0]
        text = first.get("text") if endpoint == "completions" else (first.get("delta") or {}).get("content")
        if text:
            if res.ttft is None:
                res.ttft = elapsed
            else:
                res.itl.append(elapsed - res.last_content)
            res.last_content = elapsed
            res.content_chunks += 1
    usage = chunk.get("usage")
    if usage:
        res.output_tokens = usage.get("completion_tokens", res.output_tokens)
        res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)


async def send_one(
    client: httpx.AsyncClient, url: str, body: dict, endpoint: str, timeout: float
) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    try:
        # httpx's timeouts bound each connect/read/write; asyncio.timeout bounds the whole request, so a
        # server trickling chunks forever cannot hang the run.
        async with asyncio.timeout(timeout), client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                feed_line(res, endpoint, line, time.perf_counter() - start)
                if res.done:
                    break
        if not res.done and res.error is None:
            res.error = "stream ended without data: [DONE]"
    except TimeoutError:
        res.error = f"timeout: no complete response within {timeout:g} s"
    except Exception as e:  # every failure must reach the report rather than kill the run
        res.error = res.error or f"{type(e).__name__}: {e}"
    return res


def stats_ms(values_s: list[float]) -> dict:
    """Mean and p50/p90/p99 in ms; percentiles interpolate linearly, as numpy's default does."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = [v * 1000 for v in values_s]
    cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else [ms[0]] * 99
    return {
        k: round(v, 3)
        for k, v in {"mean": statistics.fmean(ms), "p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}.items()
    }


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """Counts, throughputs and latency statistics (ms) of one run's results."""
    good = [r for r in results if r.ok]
    errors = list(dict.fromkeys(r.error or "incomplete" for r in results if not r.ok))
    tokens = sum(r.output_tokens or 0 for r in good)
    secs = max(duration_s, 1e-9)  # a run never takes 0 s; this only guards the division
    return {
        "num_requests": len(results),
        "completed": len(good),
        "failed": len(results) - len(good),
        "errors": errors[:MAX_ERRORS],
        "duration_s": round(duration_s, 3),
        "request_throughput": round(len(good) / secs, 3),
        "output_throughput_tok_s": round(tokens / secs, 3),
        "total_output_tokens": tokens,
        "ttft_ms": stats_ms([r.ttft for r in good if r.ttft is not None]),
        "itl_ms": stats_ms([gap for r in good for gap in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in good]),
    }


async def run_rate(
    client: httpx.AsyncClient,
    args: argparse.Namespace,
    base: str,
    model: str,
    prompts: list[str],
    rate: float,
) -> dict:
    offsets = arrival_times(args.num_requests, rate, args.arrival, args.seed or 0)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    bar = tqdm(
        total=args.num_requests,
        desc=f"rate {rate:g}/s",
        unit="req",
        disable=args.no_progress or not sys.stderr.isatty(),
    )
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        path, body = build_request(
            args.endpoint,
            model,
            prompts[i % len(prompts)],
            args.max_tokens,
            args.temperature,
            args.seed,
            args.ignore_eos,
        )
        async with sem:
            res = await send_one(client, base + path, body, args.endpoint, args.timeout)
        bar.update(1)
        return res

    results = await asyncio.gather(*(one(i) for i in range(args.num_requests)))
    duration = time.perf_counter() - t0
    bar.close()
    return {"rate": "inf" if math.isinf(rate) else rate, **summarize(results, duration)}


async def discover_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        resp = await client.get(f"{base}/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:
        raise SetupError(f"no --model given and GET {base}/models failed: {type(e).__name__}: {e}") from e


async def run(args: argparse.Namespace) -> dict:
    base = args.base_url.rstrip("/")
    prompts = Path(args.prompts).read_text().splitlines() if args.prompts else DEFAULT_PROMPTS
    prompts = [p for p in prompts if p.strip()] or DEFAULT_PROMPTS
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No pool cap: httpx's default (100) would queue requests inside the client, silently lowering the
    # offered load; --max-concurrency is the only intended bound.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model or await discover_model(client, base)
        runs = [await run_rate(client, args, base, model, prompts, rate) for rate in args.rates]
    return {
        "base_url": base,
        "endpoint": args.endpoint,
        "model": model,
        "max_tokens": args.max_tokens,
        "arrival": args.arrival,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "node": platform.node(),
        },
        "runs": runs,
    }


def plot(report: dict, path: str) -> None:
    """Latency (p50/p99 TTFT and e2e) against achieved request throughput, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(report["runs"], key=lambda r: r["request_throughput"])
    x = [r["request_throughput"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for metric, name, color in (("ttft_ms", "TTFT", "C0"), ("e2e_ms", "e2e", "C3")):
        for q, style in (("p50", "-o"), ("p99", "--s")):
            y = [math.nan if r[metric][q] is None else r[metric][q] for r in runs]
            ax.plot(x, y, style, color=color, label=f"{name} {q}")
    for r, xi in zip(runs, x, strict=True):
        if r["e2e_ms"]["p99"] is not None:
            label = "inf" if r["rate"] == "inf" else f"{r['rate']:g}/s"
            ax.annotate(
                label, (xi, r["e2e_ms"]["p99"]), textcoords="offset points", xytext=(4, 6), fontsize=8
            )
    ax.set(
        xlabel="achieved request throughput (req/s); labels: offered rate",
        ylabel="latency (ms)",
        title=f"{report['model']} /{report['endpoint']}, max_tokens={report['max_tokens']}",
    )
    ax.margins(x=0.08, y=0.12)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # "tight" keeps labels at the edges in the image
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", help="default: the first id of GET /models")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf = all at once")
    p.add_argument("--rates", help="comma-separated sweep, e.g. 1,2,4,inf (overrides --request-rate)")
    p.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    p.add_argument("--max-concurrency", type=int, help="bound on requests in flight")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", help="file with one prompt per line")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, help="seeds the arrivals (default 0); if given, also sent as seed")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request, in all")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--plot", help="PNG of latency against throughput")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.request_rate]
    except ValueError:
        p.error(f"--rates: not a comma-separated list of numbers: {args.rates!r}")
    if any(not r > 0 for r in args.rates):  # `not >` also rejects nan
        p.error("rates must be > 0")
    if args.num_requests < 1 or (args.max_concurrency is not None and args.max_concurrency < 1):
        p.error("--num-requests and --max-concurrency must be >= 1")
    if args.prompts and not Path(args.prompts).is_file():
        p.error(f"--prompts: no such file {args.prompts}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(run(args))
    except SetupError as e:
        print(f"openai_load: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0 if all(r["failed"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
