"""`loadtest/online_vs_vllm.py`'s verdict over repeated runs: medians, and the runs meeting the goal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loadtest_scripts import load_script

online = load_script("online_vs_vllm")


def result(tok_s: float, ttft_ms: float, tpot_ms: float, completed: int = 64) -> dict:
    return {
        "output_throughput": tok_s,
        "mean_ttft_ms": ttft_ms,
        "mean_tpot_ms": tpot_ms,
        "completed": completed,
    }


VLLM = result(4000, 300, 12)


def test_a_run_meets_the_goal_only_with_all_three_and_every_request_completed():
    runs = [
        {"vllm": VLLM, "parkade": result(4400, 270, 11)},  # all three
        {"vllm": VLLM, "parkade": result(4400, 330, 11)},  # TTFT worse
        {"vllm": VLLM, "parkade": result(3800, 240, 12)},  # throughput lower
        {"vllm": VLLM, "parkade": result(4400, 270, 11, completed=63)},  # a request lost
        {"parkade": result(4000, 300, 12)},  # vLLM skipped: no ratio
    ]
    assert online.ratios_of(runs[0]) == pytest.approx(
        {"output_throughput": 1.1, "mean_ttft": 0.9, "mean_tpot": 11 / 12}
    )
    assert online.ratios_of(runs[4]) == {}
    verdict = online.summarize(runs, num_prompts=64)
    assert verdict["runs_meeting_goal"] == 1
    # Medians over the four runs with both servers (an even count: the mean of the middle two).
    assert verdict["parkade_over_vllm"] == {"output_throughput": 1.1, "mean_ttft": 0.9, "mean_tpot": 0.917}
    assert online.summarize([runs[4]], num_prompts=64) == {"parkade_over_vllm": {}, "runs_meeting_goal": 0}


@pytest.mark.parametrize("parkade", [result(3990, 300, 12), result(4000, 301, 12), result(4000, 300, 12.05)])
def test_a_run_just_short_of_vllm_does_not_meet_the_goal(parkade):
    assert online.summarize([{"vllm": VLLM, "parkade": parkade}], num_prompts=64)["runs_meeting_goal"] == 0


def test_the_ttft_deciles_leave_out_failed_requests():
    ttfts = [i / 1000 for i in range(101)]  # 0 to 100 ms
    assert online.ttft_deciles_ms({"ttfts": ttfts}) == [float(10 * i) for i in range(11)]
    # A failed request's TTFT (0, as the client records it) is not a first token.
    failed = {"ttfts": [0.0, 0.2, 0.1], "errors": ["timeout", "", ""]}
    assert online.ttft_deciles_ms(failed) == [100.0] * 5 + [200.0] * 6
    assert online.ttft_deciles_ms({"ttfts": [0.0], "errors": ["refused"]}) == []
    assert online.ttft_deciles_ms({}) == []


@pytest.mark.parametrize(
    ("argv", "label"),
    [
        (["/venv/bin/python3", "-P", "-m", "parkade.cli", "executor", "--model", "m"], "executor"),
        (["/venv/bin/python3", "/venv/bin/parkade", "up", "--model", "m"], "parkade up"),
        (["/home/.calfkit/bin/tansu-v0.6.0-510f3e2", "broker", "--listener-url", "x"], "tansu"),
        (
            ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"],
            "vllm.entrypoints.openai.api_server",
        ),
        (["VLLM::EngineCore"], "VLLM::EngineCore"),
    ],
)
def test_each_server_process_is_labelled_by_its_role(argv, label):
    assert online.process_label(argv) == label


BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
# Starts a child in a session of its own (as `parkade up` starts its services) and says its pid;
# each spends 0.3 s of CPU, then sleeps.
PARENT = f"""import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {BURN + "time.sleep(30)"!r}], start_new_session=True)
print(child.pid, flush=True)
{BURN}child.wait()"""


def test_a_servers_cpu_counts_its_process_tree_and_no_other():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        deadline = time.monotonic() + 20
        while sum((spent := online.tree_cpu_s(proc.pid)).values()) < 0.6:
            assert time.monotonic() < deadline, spent
            time.sleep(0.05)
        assert list(spent) == [Path(sys.executable).name.split("-")[0]]
        assert sum(spent.values()) < 5  # its tree alone, not this test's process
        assert online.tree_cpu_s(2**22 + 1) == {}  # past pid_max's limit: no such process
    finally:
        os.kill(child, signal.SIGKILL)
        proc.wait()


def test_the_warm_up_draws_no_prompt_of_the_timed_round(monkeypatch, tmp_path):
    rounds = []
    monkeypatch.setattr(online, "wait_ready", lambda url, proc, timeout_s: 1.0)
    monkeypatch.setattr(online, "stop", lambda proc: proc.wait())
    monkeypatch.setattr(online, "bench", lambda *a: rounds.append(a[3:]) or {"completed": a[4]})
    args = online.argparse.Namespace(num_prompts=64, ready_timeout=1.0)
    online.serve_and_bench(args, "server", [sys.executable, "-c", "pass"], dict(os.environ), 0, tmp_path)
    (warm_name, warm_n, warm_seed), (name, n, seed) = rounds
    assert (warm_name, warm_n, name, n) == ("server-warmup", 16, "server", 64)
    # vLLM's random dataset: one seed, the same first prompts at any count
    assert warm_seed != seed
