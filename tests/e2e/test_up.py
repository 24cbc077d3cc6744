"""`parkade up` then `parkade generate`, as a user runs them: real broker, real services, subprocesses.

Each test starts its own `parkade up` (its own Tansu broker on a free port, PARKADE_HOME in a tmp
folder), streams one completion, then sends SIGTERM and checks that every child is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from byte_model import make_byte_model
from stack import START_TIMEOUT_S, STOP_TIMEOUT_S, Up, running

pytestmark = pytest.mark.e2e


def _run_and_stop(up: Up, prompt: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Stream one completion from a ready `up`, stop it, and check that it left nothing behind."""
    try:
        state = up.wait_ready()
        result = up.generate(prompt, *args)
    finally:
        code = up.stop()
    assert code == 0, f"parkade up exit code {code}:\n{up.output()}"
    assert set(state["pids"]) == {"broker", "replica", "gateway"}  # the tokenizer in the gateway's
    left = [name for name, pid in state["pids"].items() if running(pid)]
    assert not left, f"still running after parkade up exited: {left}"
    assert not (up.home / "up.json").exists()
    return result


def _ask_the_gateway(url: str):
    """`parkade up`'s gateway: /health once the services heartbeat, then one completion."""
    import httpx
    import openai

    deadline = time.monotonic() + 30
    while (health := httpx.get(url.removesuffix("/v1") + "/health")).status_code != 200:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)
    client = openai.OpenAI(base_url=url, api_key="unused")
    completion = client.completions.create(
        model="stories260K", prompt="Once upon a time", max_tokens=20, temperature=0
    )
    return health.json(), completion


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _autogroup_nice(pid: int) -> int | None:
    path = Path(f"/proc/{pid}/autogroup")  # "/autogroup-123 nice 5"
    return int(path.read_text().split()[-1]) if path.exists() else None


def test_up_serves_the_shipped_model_and_hands_each_service_its_flags(tmp_path):
    flags = ["--block-size", "8", "--max-model-len", "256", "--max-num-seqs", "8"]
    flags += ["--scheduling-policy", "priority", "--no-enable-prefix-caching", "--max-in-flight", "2"]
    up = Up(tmp_path, *flags, "--router", "round-robin", "--pipeline-nice", "5")
    try:
        state = up.wait_ready()
        commands = {name: _cmdline(pid) for name, pid in state["pids"].items() if name != "broker"}
        nice = {name: _nice(pid) - _nice(up.proc.pid) for name, pid in state["pids"].items()}
        groups = {name: _autogroup_nice(pid) for name, pid in state["pids"].items()}
        policies = {name: os.sched_getscheduler(pid) for name, pid in state["pids"].items()}
        result = up.generate("Once upon a time", "--temperature", "0", "--max-tokens", "20")
        health, completion = _ask_the_gateway(state["gateway_url"])
    finally:
        code = up.stop()
    assert code == 0, up.output()
    replicas = health.pop("replicas")
    assert health == {"status": "ok", "broker": True, "services_missing": []}
    assert list(replicas) == ["0"] and replicas["0"]["serving"], replicas  # 200: a replica serves
    assert completion.choices[0].text == result.stdout.removeprefix("Once upon a time").rstrip("\n")
    # The replica (its scheduler and executor in one process) takes both services' flags.
    replica = " ".join(commands["replica"])
    assert "-m parkade.cli replica " in replica and "--replica 0" in replica
    assert "--block-size 8 --max-model-len 256" in replica and "--max-num-seqs 8" in replica
    assert "--scheduling-policy priority" in replica and "--no-enable-prefix-caching" in replica
    # The gateway runs the tokenizer (the one tokenizer), with the tokenizer's flags.
    gateway = " ".join(commands["gateway"])
    assert "-m parkade.cli gateway " in gateway and "--with-tokenizer --router round-robin" in gateway
    assert "--max-in-flight 2" in replica and "--max-num-seqs" not in gateway
    assert "--model" not in gateway  # the default: nothing to pass
    # --pipeline-nice: every child but the replica (the executor) below it, in its session's group too.
    assert nice == {"broker": 5, "replica": 0, "gateway": 5}, nice
    if groups["replica"] is not None:  # a kernel with autogroup
        assert groups == {"broker": 5, "replica": 0, "gateway": 5}, groups
    # --pipeline-policy (default batch): the same children's wake-ups do not preempt the replica's.
    assert policies == {"broker": os.SCHED_BATCH, "replica": os.SCHED_OTHER, "gateway": os.SCHED_BATCH}
    assert result.returncode == 0, f"{result.stderr}\n{up.output()}"
    # The trained stories260K, greedy: the story its authors document.
    assert result.stdout.startswith("Once upon a time, there was a little girl named Lily"), result.stdout
    assert result.stderr.startswith("[finish_reason=length, tokens=20, request_id=")


def test_up_and_generate_on_a_model_folder_given_with_model(tmp_path):
    model = make_byte_model(tmp_path / "byte")
    up = Up(tmp_path / "home", "--model", str(model))
    result = _run_and_stop(up, "Once upon a time", "--max-tokens", "16", "--seed", "1", "--ignore-eos")
    assert result.returncode == 0, f"{result.stderr}\n{up.output()}"
    assert result.stdout.startswith("Once upon a time") and len(result.stdout) > len("Once upon a time\n")
    assert "tokens=16" in result.stderr


def test_ctrl_c_while_starting_stops_quietly_and_exits_0(tmp_path):
    up = Up(tmp_path)
    replica_log = tmp_path / "logs" / "latest" / "replica.log"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not replica_log.exists():  # the services are starting: loading torch and the model
        assert up.proc.poll() is None, up.output()
        assert time.monotonic() < deadline, up.output()
        time.sleep(0.05)
    assert not (tmp_path / "up.json").exists()  # not ready yet
    up.proc.send_signal(signal.SIGINT)
    code = up.proc.wait(STOP_TIMEOUT_S)
    assert code == 0, up.output()
    assert "exited with code" not in up.log_path.read_text(), up.output()


def test_a_killed_service_is_restarted_and_the_stack_serves_on(tmp_path):
    up = Up(tmp_path / "home")
    try:
        state = up.wait_ready()
        os.kill(state["pids"]["replica"], signal.SIGKILL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (fresh := up.wait_ready())["pids"]["replica"] == state["pids"]["replica"]:
            assert up.proc.poll() is None, f"parkade up stopped:\n{up.output()}"
            assert time.monotonic() < deadline, f"no restart in {START_TIMEOUT_S}s:\n{up.output()}"
            time.sleep(0.5)
        result = up.generate("Once upon a time", "--max-tokens", "8")
    finally:
        code = up.stop()
    assert result.returncode == 0, f"{result.stderr}\n{up.output()}"
    assert code == 0, up.output()
    assert "restarting the replica in 1s (restart 1)" in up.log_path.read_text()
    assert "restart 1 of the replica" in (up.home / "logs" / "latest" / "replica.log").read_text()
    assert not running(fresh["pids"]["replica"])


def test_a_second_stack_on_the_same_broker_is_refused_and_a_rebalance_heals(tmp_path):
    """A second `parkade up` pointed at the first one's broker: each of its services refuses to
    start (another instance serves the topics), it stops, and the first serves on. Then a member
    that joins and leaves the scheduler's group (a forced rebalance) leaves it serving."""
    import asyncio

    from aiokafka import AIOKafkaConsumer

    first = Up(tmp_path / "first")
    try:
        state = first.wait_ready()
        second = Up(tmp_path / "second", broker=state["bootstrap_servers"])
        code = second.proc.wait(START_TIMEOUT_S)
        assert code != 0, second.output()
        logs = [
            (second.home / "logs" / "latest" / f"{name}.log").read_text()
            for name in ("gateway", "replica")  # the gateway's tokenizer claims its instance
            if (second.home / "logs" / "latest" / f"{name}.log").exists()
        ]
        # Every service that reached the broker refused to start; `parkade up` stops at the first
        # refusal, so a slower one (the executor, loading) may be stopped before it gets there.
        reached = [log for log in logs if "starting: broker" in log]
        assert reached and all("refusing to start: another" in log for log in reached), second.output()
        assert not any('"event": "ready"' in log for log in logs), second.output()
        assert first.generate("Once upon a time", "--max-tokens", "8").returncode == 0, first.output()

        async def join_and_leave():
            group, broker = "parkade-scheduler", state["bootstrap_servers"]
            intruder = AIOKafkaConsumer("parkade.tokenized", bootstrap_servers=broker, group_id=group)
            await intruder.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not intruder.assignment():  # it took a partition
                await intruder.getmany(timeout_ms=200)
            assert intruder.assignment(), "the intruder never joined the group"
            await intruder.stop()

        asyncio.run(join_and_leave())
        started = time.monotonic()
        result = first.generate("Once upon a time", "--max-tokens", "8")
        assert result.returncode == 0, f"{result.stderr}\n{first.output()}"
        assert time.monotonic() - started < 30

        # The broker dies mid-stream: the client says so in one line, exit status 1, within
        # seconds; `parkade up` stops (the topics lived in the broker's memory).
        client = subprocess.Popen(
            [
                sys.executable,
                "-P",
                "-m",
                "parkade.cli",
                "generate",
                "Once upon a time",
                "--max-tokens",
                "480",
            ],
            env=first.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert client.stdout.read(len("Once upon a time") + 3)  # the prompt, then generated text
        os.kill(state["pids"]["broker"], signal.SIGKILL)
        killed = time.monotonic()
        _, err = client.communicate(timeout=60)
        assert client.returncode == 1 and time.monotonic() - killed < 15, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("parkade generate:"), err
        assert first.proc.wait(STOP_TIMEOUT_S) != 0
    finally:
        first.stop()


# What each process's endpoint must show after one completion: a family of its own that counted
# the work, and one that every service of its kind exports.
METRICS = {
    # The scheduler's and the executor's, at one endpoint.
    "replica": ("parkade:e2e_request_latency_seconds", "parkade:steps", "parkade:kv_cache_usage_perc"),
    # The gateway's and its tokenizer's.
    "gateway": ("parkade:gateway_requests", "parkade:tokenizer_requests", "parkade:consumer_lag"),
}


def _scrape(url: str) -> dict[str, list]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, (url, response.text)
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def test_every_service_metrics_and_the_api_key_under_up(tmp_path):
    """`parkade up --api-key`: every process serves its metrics at the URL up.json and the banner
    name; the gateway wants the key; stopping says so at once and when done."""
    import httpx

    up = Up(tmp_path, "--api-key", "k-123")
    try:
        state = up.wait_ready()
        url = state["gateway_url"]
        body = {"prompt": "Once upon a time", "max_tokens": 8}
        assert httpx.post(f"{url}/completions", json=body, timeout=60).status_code == 401
        answer = httpx.post(
            f"{url}/completions", json=body, headers={"Authorization": "Bearer k-123"}, timeout=120
        )
        assert answer.status_code == 200, answer.text
        scraped = {name: _scrape(metrics_url) for name, metrics_url in state["metrics"].items()}
        gateway_http = _scrape(url.removesuffix("/v1") + "/metrics")
        words = [w for name, pid in state["pids"].items() if name != "broker" for w in _cmdline(pid)]
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert list(scraped) == ["replica", "gateway"]
    banner = up.log_path.read_text()
    assert "Metrics (Prometheus): " + ", ".join(f"{n} {u}" for n, u in state["metrics"].items()) in banner
    for name, families in scraped.items():
        samples = [s for family in families.values() for s in family]
        assert not [s.name for s in samples if s.name.endswith("_created")], name
        *counted_by, always = METRICS[name]
        assert families.get(always), f"{name}: no {always} samples"
        for counted in counted_by:
            values = [s.value for s in families.get(counted, []) if not s.name.endswith("_bucket")]
            assert values and max(values) > 0, f"{name}: {counted} counted nothing: {families.get(counted)}"
    assert set(gateway_http) == set(scraped["gateway"])  # the same registry, at either port
    assert "k-123" not in words and "--api-key" not in words  # the key went by the environment
    stopping, stopped = banner.index("parkade up: stopping"), banner.index("parkade up: stopped")
    assert stopping < stopped and "the embedded broker held" in banner[stopped:]
    # Each service's log: a clean start and stop have no warning, and the stop is in it.
    for name in ("replica", "gateway"):
        lines = (tmp_path / "logs" / "latest" / f"{name}.log").read_text().splitlines()
        events = [json.loads(line) for line in lines if line.startswith("{")]
        assert [e for e in events if e["level"] not in ("info", "debug")] == [], name
        said = [e["event"] for e in events]
        assert "stopping (SIGTERM): finishing what is in flight" in said and said[-1] == "stopped", name
