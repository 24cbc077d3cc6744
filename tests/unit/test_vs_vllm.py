"""`loadtest/vs_vllm.py --cap-isa`: every engine's process gets the caps, and the summary says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest_scripts import LOADTEST, load_script

vs_vllm = load_script("vs_vllm")

# Stands in for the anchors' vLLM script: reports the caps it was started with, as its --out.
FAKE_VLLM = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
caps = {k: os.environ.get(k) for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "PARKADE_CPU_MARCH")}
json.dump({"caps": caps, "headline": {"main": {"output_tok_per_s": 100.0}}}, open(out, "w"))
"""


def run(tmp_path: Path, *extra: str) -> dict:
    anchors = tmp_path / "anchors"
    anchors.mkdir(exist_ok=True)
    (anchors / "bench_vllm_cpu.py").write_text(FAKE_VLLM)
    command = [sys.executable, str(LOADTEST / "vs_vllm.py"), "--model", str(tmp_path / "m")]
    command += ["--anchors", str(anchors), "--vllm-python", sys.executable]
    command += ["--skip", "naive,parkade,baseline", *extra]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout)


def test_a_capped_run_caps_every_engine_and_says_so(tmp_path):
    summary = run(tmp_path, "--cap-isa", "avx2")
    assert summary["results"]["vllm"]["caps"] == vs_vllm.ISA_CAPS["avx2"]
    assert summary["isa_cap"] == {"isa": "avx2", **vs_vllm.ISA_CAPS["avx2"]}
    assert summary["output_tok_per_s"] == {"vllm": 100.0}


def test_an_uncapped_run_leaves_the_environment_alone(tmp_path, monkeypatch):
    for name in vs_vllm.ISA_CAPS["avx2"]:
        monkeypatch.delenv(name, raising=False)
    summary = run(tmp_path)
    assert summary["isa_cap"] is None
    assert set(summary["results"]["vllm"]["caps"].values()) == {None}
