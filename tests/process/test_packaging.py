"""What `pip install` gets: every package, and the default model as package data."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from parkade.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_every_package_the_kernel_source_and_the_default_model(tmp_path):
    # A copy of the source: a build leaves build/ behind, whose stale files a later build would ship.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__"))
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip_wheel, "-w", str(tmp_path), "."], cwd=source, check=True, timeout=300)
    (wheel,) = tmp_path.glob("parkade-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("services", "schemas", "kernels", "parkade"):  # every module of every code folder
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.c")]:  # C: the CPU kernel
            relative = path.relative_to(ROOT / folder).as_posix()
            inside = relative if folder == "parkade" else f"{folder}/{relative}"
            assert f"parkade/{inside}" in names, inside
    shipped = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"LICENSE", "README.md", "config.json", "model.safetensors", "tokenizer.json"} <= shipped
    assert {f"parkade/models/stories260K/{name}" for name in shipped} <= names
