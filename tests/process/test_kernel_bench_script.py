"""`loadtest/kernel_bench.py` run whole, as a script (dry runs, under the Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadtest_scripts import load_script

kb = load_script("kernel_bench")
SCRIPT = Path(kb.__file__)


def test_dry_run_prints_the_report():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--peak-gbps", "100"],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["dry_run"] is True and doc["peak_gbps"] == 100.0 and doc["skipped"] == []
    assert doc["shape"]["dtype"] == "float32"
    [case] = doc["cases"]
    assert (case["batch"], case["context"]) == (2, 64)
    assert case["kv_bytes"] == kb.kv_bytes(kb.Case(2, 64), kb.TINY)
    assert case["max_abs_err"] is not None and case["max_abs_err"] < 1e-5
    assert doc["max_abs_err"] == case["max_abs_err"]
    for key in ("triton_ms", "triton_GBps", "triton_frac_peak", "sdpa_ms", "sdpa_GBps", "sdpa_frac_peak"):
        assert case[key] > 0, key


def test_launch_sweep_dry_run_times_each_launch_and_agrees_with_the_default():
    env = os.environ | {"TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--launch-sweep"],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    [row] = doc["results"]
    assert len(row["all"]) == 2 * 2  # two key tiles x (1 warp count x 2 stage counts)
    for launch in row["all"]:
        assert launch["ms"] > 0 and launch["max_abs_diff"] < 1e-5
    assert row["best"] in row["all"] and row["chosen_ms"] > 0
