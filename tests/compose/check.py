"""The checks of the compose test, run by tests/compose/run.sh against a stack it brought up.

Each check prints one line (ok / FAILED / skipped, with its time and what it saw) and the run
exits 1 if any failed. The stack is looked at from this machine: the gateway and Kafka through
their published ports; traces in the files the OTLP sink wrote; metrics from inside the gateway's
container, at the addresses Prometheus scrapes (deploy/prometheus.yml).
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
PARKADE = Path(sys.executable).parent / "parkade"
PROMPT = "Once upon a time"
MAX_TOKENS = 20
SERVICES = ("tokenizer", "scheduler", "executor", "gateway")


class CheckFailed(Exception):
    """A check saw something wrong; the message says what."""


@dataclass
class Run:
    compose: list[str]
    gateway: str
    kafka: str
    otlp_dir: Path
    results: list[tuple[str, str, float, str]] = field(default_factory=list)
    expected: str = ""

    def check(self, name: str, body: Callable[[], str], skip: str | None = None) -> bool:
        """Runs one check; `skip` names why it is left out."""
        if skip:
            self.report(name, "skipped", 0.0, skip)
            return True
        start = time.monotonic()
        try:
            detail = body()
        except CheckFailed as error:
            self.report(name, "FAILED", time.monotonic() - start, str(error))
            return False
        self.report(name, "ok", time.monotonic() - start, detail)
        return True

    def report(self, name: str, outcome: str, seconds: float, detail: str) -> None:
        self.results.append((name, outcome, seconds, detail))
        print(f"[{outcome}] {name} ({seconds:.1f}s): {detail}", flush=True)

    def docker_compose(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [*self.compose, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            raise CheckFailed(f"{shlex.join(args)}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def container(self, service: str) -> str:
        container = self.docker_compose("ps", "-q", service).strip()
        if not container:
            raise CheckFailed(f"no container for {service}")
        return container


def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except (OSError, urllib.error.URLError) as error:
        return 0, str(error).encode()


def parkade(*args: str, timeout: float) -> str:
    """stdout of the `parkade` command of this machine's venv."""
    try:
        done = subprocess.run(
            [str(PARKADE), *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as error:
        raise CheckFailed(f"parkade {args[0]}: no answer within {timeout:.0f}s") from error
    if done.returncode != 0:
        raise CheckFailed(f"parkade {args[0]} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return done.stdout.rstrip("\n")


def greedy_args() -> list[str]:
    return [PROMPT, "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]


def wait_healthy(run: Run, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    status, body = 0, b""
    while time.monotonic() < deadline:
        status, body = http(f"{run.gateway}/health", timeout=5)
        if status == 200:
            return f"GET /health 200: {body.decode(errors='replace').strip()[:200]}"
        time.sleep(2)
    said = body.decode(errors="replace")[:300]
    raise CheckFailed(f"GET /health still {status} after {timeout:.0f}s: {said}")


def topics_job(run: Run) -> str:
    container = run.docker_compose("ps", "-a", "-q", "topics").strip()
    if not container:
        raise CheckFailed("no topics container")
    code = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.ExitCode}}", container],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    log = run.docker_compose("logs", "--no-color", "topics")
    if code != "0":
        raise CheckFailed(f"`parkade topics --create` exited {code}: {log.strip()[-400:]}")
    if "parkade.requests" not in log:
        raise CheckFailed(f"its output does not list parkade.requests: {log.strip()[-400:]}")
    return "exited 0, listed parkade.requests ..."


def offline(run: Run) -> str:
    run.expected = parkade("offline", *greedy_args(), timeout=300)
    if not run.expected.startswith(PROMPT):
        raise CheckFailed(f"`parkade offline` printed {run.expected!r}")
    return repr(run.expected)


def kafka_request(run: Run, timeout: float = 120) -> str:
    text = parkade(
        "generate",
        *greedy_args(),
        "--bootstrap-servers",
        run.kafka,
        "--timeout",
        str(timeout),
        timeout=timeout + 30,
    )
    if text != run.expected:
        raise CheckFailed(f"got {text!r}, the in-process engine gives {run.expected!r}")
    return f"{text[len(PROMPT) :][:40]!r}... equals the in-process engine's"


def gateway_request(run: Run) -> str:
    status, body = http(f"{run.gateway}/v1/models")
    if status != 200:
        raise CheckFailed(f"GET /v1/models: {status} {body[:300]!r}")
    model = json.loads(body)["data"][0]["id"]
    request = {"model": model, "prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    status, body = http(f"{run.gateway}/v1/completions", request, timeout=120)
    if status != 200:
        raise CheckFailed(f"POST /v1/completions: {status} {body[:300]!r}")
    text = PROMPT + json.loads(body)["choices"][0]["text"]
    if text != run.expected:
        raise CheckFailed(f"got {text!r}, the in-process engine gives {run.expected!r}")
    return f"model {model}: equals the in-process engine's"


def spans_by_trace(otlp_dir: Path) -> dict[str, set[str]]:
    """trace id -> the service.name of every resource with a span in it, from the sink's files."""
    try:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    except ImportError as error:
        raise CheckFailed(f"cannot decode OTLP here ({error}): install opentelemetry-proto") from error
    traces: dict[str, set[str]] = defaultdict(set)
    for path in sorted(otlp_dir.glob("traces-*")):
        if path.suffix == ".json":
            export = json.loads(path.read_bytes())
        else:
            message = ExportTraceServiceRequest()
            message.ParseFromString(path.read_bytes())
            export = MessageToDict(message)
            # bytes come out base64 there; OTLP JSON (and Jaeger's UI) write trace ids in hex
            for resource_spans in export.get("resourceSpans", []):
                for scope_spans in resource_spans.get("scopeSpans", []):
                    for span in scope_spans.get("spans", []):
                        span["traceId"] = base64.b64decode(span["traceId"]).hex()
        for resource_spans in export.get("resourceSpans", []):
            attributes = resource_spans.get("resource", {}).get("attributes", [])
            name = next(
                (a["value"].get("stringValue", "") for a in attributes if a["key"] == "service.name"), "?"
            )
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    # An engine replica's scheduler and executor (parkade-scheduler-1) count as
                    # the scheduler and the executor: a request runs on one replica of them.
                    traces[span["traceId"]].add(re.sub(r"-\d+$", "", name))
    return traces


def traces(run: Run, timeout: float = 45) -> str:
    wanted = {f"parkade-{service}" for service in SERVICES}
    deadline = time.monotonic() + timeout  # the services export in batches, every few seconds
    while True:
        found = spans_by_trace(run.otlp_dir)
        complete = [trace for trace, names in found.items() if wanted <= names]
        if complete:
            names = ", ".join(sorted(wanted))
            return f"trace {complete[0]} has spans of {names} ({len(found)} traces in all)"
        if time.monotonic() > deadline:
            break
        time.sleep(3)
    if not found:
        raise CheckFailed(f"the OTLP sink got no spans in {timeout:.0f}s (is tracing on in the services?)")
    seen = set().union(*found.values())
    best = max(found.values(), key=len)
    raise CheckFailed(
        f"no trace with spans of all four services: services seen {sorted(seen)}; the most in one "
        f"trace: {sorted(best)}; missing from it: {sorted(wanted - best)}"
    )


def metrics(run: Run) -> str:
    """Fetches every target of deploy/prometheus.yml from inside the gateway's container (the
    network Prometheus scrapes from); each must answer 200 with `parkade:` metrics."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = [t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    probe = (
        "import sys, urllib.request\n"
        "for target in sys.argv[1:]:\n"
        "    try:\n"
        "        with urllib.request.urlopen(f'http://{target}/metrics', timeout=10) as answer:\n"
        "            lines = answer.read().decode().splitlines()\n"
        "            names = {l.split('{')[0].split(' ')[0] for l in lines if l.startswith('parkade:')}\n"
        "            print(target, answer.status, len(names))\n"
        "    except Exception as error:\n"
        "        print(target, 'error', repr(error).replace(' ', '_'))\n"
    )
    out = subprocess.run(
        ["docker", "exec", run.container("gateway"), "python", "-c", probe, *targets],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if out.returncode != 0:
        raise CheckFailed(f"docker exec: {out.stderr.strip()[-300:]}")
    bad, good = [], []
    for line in out.stdout.splitlines():
        target, status, count = line.split(" ", 2)
        if status != "200" or count == "0":
            bad.append(f"{target}: {status} {count if status != '200' else 'no parkade: metrics'}")
        else:
            good.append(f"{target} ({count} parkade: metrics)")
    if bad:
        raise CheckFailed("; ".join(bad) + (f"; fine: {', '.join(good)}" if good else ""))
    return ", ".join(good)


def restart_count(container: str) -> int:
    out = subprocess.run(
        ["docker", "inspect", "-f", "{{.RestartCount}}", container],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(out.stdout.strip() or -1)


def crash_and_recover(run: Run, service: str = "scheduler", limit: float = 90) -> str:
    """SIGKILL one service's process: its restart policy brings the container back, and a request
    sent right after the kill is answered, with the same text, within `limit` seconds.

    NOTE: not `docker kill`: Docker takes that for a stop by hand, which a restart policy leaves
    stopped (seen with Docker 20.10: `Exited (137)`, never restarted). A crash is the process
    dying inside: `kill -9 -1` in the container signals every process but PID 1 (compose.yaml's
    `init: true`) and the shell itself, so the service dies and the container exits with 137."""
    container = run.container(service)
    before = restart_count(container)
    subprocess.run(["docker", "exec", container, "sh", "-c", "kill -9 -1"], capture_output=True, check=False)
    killed = time.monotonic()
    kafka_request(run, timeout=limit)
    served = time.monotonic() - killed
    after = restart_count(container)
    if after <= before:
        raise CheckFailed(f"a request was served, but {service} was not restarted (restarts: {after})")
    wait_healthy(run, timeout=60)
    return (
        f"{service} restarted (restart count {before} -> {after}); a request sent after the kill "
        f"was served in {served:.1f}s; /health 200 again after {time.monotonic() - killed:.1f}s"
    )


def two_replicas(run: Run, timeout: float = 120) -> str:
    """/health lists engine replicas 0 and 1 (the `replicas` profile), both serving."""
    deadline = time.monotonic() + timeout
    replicas: dict = {}
    while time.monotonic() < deadline:
        status, body = http(f"{run.gateway}/health", timeout=5)
        replicas = json.loads(body).get("replicas", {}) if status == 200 else {}
        if {"0", "1"} <= set(replicas) and all(replicas[r]["serving"] for r in ("0", "1")):
            return f"replicas serving: {sorted(replicas)}"
        time.sleep(2)
    raise CheckFailed(f"replicas 0 and 1 not both serving after {timeout:.0f}s: {replicas}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compose", required=True, help="the docker-compose command, its -p and -f included")
    parser.add_argument("--gateway", required=True, help="the gateway's URL on this machine")
    parser.add_argument("--kafka", required=True, help="Kafka's bootstrap address on this machine")
    parser.add_argument("--otlp-dir", type=Path, required=True, help="where the OTLP sink writes")
    parser.add_argument("--summary", type=Path, help="a file to append the results to")
    parser.add_argument("--skip-traces", action="store_true")
    parser.add_argument("--skip-metrics", action="store_true")
    parser.add_argument("--health-timeout", type=float, default=600)
    args = parser.parse_args()
    run = Run(shlex.split(args.compose), args.gateway.rstrip("/"), args.kafka, args.otlp_dir)

    if run.check("gateway /health 200 (the stack is up)", lambda: wait_healthy(run, args.health_timeout)):
        run.check("the topics job (parkade topics --create)", lambda: topics_job(run))
        run.check("two engine replicas serve (/health)", lambda: two_replicas(run))
        if run.check("expected text: parkade offline (in-process)", lambda: offline(run)):
            run.check("request through Kafka from this machine", lambda: kafka_request(run))
            run.check("request through the gateway (/v1/completions)", lambda: gateway_request(run))
        run.check(
            "spans of all four services in one trace",
            lambda: traces(run),
            skip="--skip-traces" if args.skip_traces else None,
        )
        run.check(
            "each service's /metrics (Prometheus' targets)",
            lambda: metrics(run),
            skip="--skip-metrics" if args.skip_metrics else None,
        )
        if run.expected:
            run.check("SIGKILL the scheduler: restarted, serving", lambda: crash_and_recover(run))

    failed = [name for name, outcome, _, _ in run.results if outcome == "FAILED"]
    if args.summary:
        with args.summary.open("a") as summary:
            for name, outcome, seconds, _ in run.results:
                summary.write(f"  {name:<48} {seconds:5.1f}s  {outcome}\n")
    if failed:
        print(f"\n{len(failed)} check(s) failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
