"""`parkade up` as a subprocess with its own PARKADE_HOME, for the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# NOTE: Tansu 0.6 (memory mode) sometimes answers every produce to one of a test's fresh topics
# with NOT_LEADER_OR_FOLLOWER until aiokafka gives up (40 s): the service whose send failed
# stops, as it is built to (under `parkade up` it is restarted and goes on from the log), and the
# test, which runs the services as tasks and restarts none, waits for an answer that cannot come.
# Seen in about one full run of three on 2026-12-01, at the pre-session commit 550cb0c as well;
# not reproduced outside the services (topic creation, concurrent producers, reply topics). The
# tests that run services in-process retry when that error is in their failure's chain: twice,
# since one test met it in two runs in a row (2026-12-06); a failed service now ends its test at
# once (tests/pipeline.py), so a retry costs aiokafka's 40 s, not the test's timeout. A retry runs
# on a broker of its own (conftest.py): one test met the error in all three attempts on its
# module's broker (2026-12-07).
TANSU_NOT_LEADER = pytest.mark.flaky(reruns=2, only_rerun=["NotLeaderForPartitionError"])

START_TIMEOUT_S = 300  # a cold start on a busy 2-core machine: broker, imports, model load
STOP_TIMEOUT_S = 60


class Up:
    """A `parkade up` subprocess with its own PARKADE_HOME."""

    def __init__(self, home: Path, *args: str, broker: str | None = None) -> None:
        """`broker`: use that one (KAFKA_BOOTSTRAP_SERVERS), rather than start the embedded one."""
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PARKADE_HOME": str(home)}
        self.env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # start the embedded broker
        if broker is not None:
            self.env["KAFKA_BOOTSTRAP_SERVERS"] = broker
        self.log_path = home / "up.log"
        with self.log_path.open("w") as log:
            if "--http-port" not in args:  # a free one: tests run stacks side by side
                args = (*args, "--http-port", "0")
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "parkade.cli", "up", *args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self) -> dict:
        state_file = self.home / "up.json"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not state_file.exists():
            assert self.proc.poll() is None, f"parkade up exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"not ready in {START_TIMEOUT_S}s:\n{self.output()}"
            time.sleep(0.5)
        return json.loads(state_file.read_text())

    def generate(self, prompt: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-P", "-m", "parkade.cli", "generate", prompt, "--timeout", "120", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )

    def stop(self) -> int | None:
        """SIGTERM; -> its exit code, or None if it was still running after STOP_TIMEOUT_S (killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def output(self) -> str:
        logs = [self.log_path, *sorted((self.home / "logs" / "latest").glob("*.log"))]
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    # A zombie is not running; it only waits for a parent that is not `parkade up` to reap it.
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")
