"""Importing a `loadtest/` script (a folder of scripts, not a package) by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

LOADTEST = Path(__file__).resolve().parents[1] / "loadtest"


def load_script(name: str) -> ModuleType:
    """`loadtest/<name>.py` as a module, registered in sys.modules (as dataclasses expect)."""
    spec = importlib.util.spec_from_file_location(name, LOADTEST / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
