"""`docker-compose config` (and `docker compose config` where Docker has it) accepts the compose
files: the YAML checks of tests/unit/test_compose_file.py, by the tool that runs them. `make
test` installs Debian's docker-compose where it may (root, apt)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def compose_commands() -> list[list[str]]:
    commands = []
    if shutil.which("docker-compose"):
        commands.append(["docker-compose"])
    if shutil.which("docker"):
        version = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if version.returncode == 0:
            commands.append(["docker", "compose"])
    return commands


@pytest.mark.parametrize(
    "files", [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"]], ids=["cpu", "gpu"]
)
def test_docker_compose_accepts_the_files(files):
    commands = compose_commands()
    if not commands:
        pytest.skip(
            "neither docker-compose nor `docker compose` is installed: the YAML checks above still ran"
        )
    for command in commands:
        arguments = [*command, "--project-directory", str(ROOT)]
        for name in files:
            arguments += ["-f", str(ROOT / name)]
        done = subprocess.run([*arguments, "config", "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(command)} config: {done.stderr}"
