"""Parkade's folder for runtime state: $PARKADE_HOME, else ~/.cache/parkade.

up.json    the running `parkade up`: its pid, broker and topic prefix (how `parkade generate`,
           `parkade topics` and `Client()` find it); written atomically once every service is
           ready, removed when it stops
logs/      each child's output, a folder per run of `parkade up` (`logs/latest`: the newest;
           see up.py)
kernels/   the CPU attention kernel's builds (kernels/attention_cpu.py)
inductor/  torch.compile's kernel cache (services/executor/compiled.py)
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from parkade.services.common.environment import parkade_home

__all__ = ["parkade_home", "read_state", "remove_state", "state_path", "write_state"]


def state_path() -> Path:
    return parkade_home() / "up.json"


def read_state() -> dict[str, Any] | None:
    """The state of the `parkade up` running now, or None (no state file, or its process is gone)."""
    try:
        state = json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and _alive(state.get("pid", -1)) else None


def write_state(state: dict[str, Any]) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the whole file or none


def remove_state() -> None:
    """Remove the state file if it is this process's."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(state_path().read_text()).get("pid") == os.getpid():
            state_path().unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True
