"""The commands as processes, no broker: a service that cannot start says why in one line and
exits with its code; the scheduler and the command line start without torch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parkade(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", "-m", "parkade.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("service", ["tokenizer", "scheduler"])
def test_a_service_that_cannot_reach_its_broker_says_so_in_one_line(service):
    bootstrap = f"127.0.0.1:{_free_port()}"
    result = _parkade(service, "--bootstrap-servers", bootstrap, "--broker-wait", "0.5")
    assert result.returncode == 1, result.stderr
    assert (
        result.stderr
        == f"parkade {service}: cannot reach the broker at {bootstrap}: nothing answered within 0.5 s\n"
    )


def test_a_service_with_a_bad_model_folder_says_so_before_connecting(tmp_path):
    result = _parkade("executor", "--bootstrap-servers", "127.0.0.1:1", "--model", str(tmp_path / "missing"))
    assert result.returncode == 2 and result.stderr.startswith("parkade executor: no model folder at")
    assert result.stderr.count("\n") == 1


def test_a_service_with_settings_that_cannot_work_says_so_in_one_line():
    env = {**os.environ, "KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}
    service = [sys.executable, "-P", "-m", "parkade.cli", "scheduler", "--bootstrap-servers", "127.0.0.1:1"]
    result = subprocess.run(service, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        "parkade scheduler: SASL_SSL needs KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD\n"
    )


@pytest.mark.parametrize(
    "module", ["parkade.services.scheduler.main", "parkade.cli", "parkade.up", "parkade.client"]
)
def test_the_scheduler_and_the_command_line_start_without_torch(module):
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-P", "-c", code], timeout=120).returncode == 0, (
        f"{module} imports torch"
    )
