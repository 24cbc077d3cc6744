"""The tree's rules, checked on the source: imports run one way, each service's `main.py` is its
only I/O edge, the scheduler and the command line stay free of torch, and nothing reaches outside
the repository."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from parkade.services import SERVICES

ROOT = Path(__file__).resolve().parents[2]
CODE = {"services": "parkade.services", "schemas": "parkade.schemas", "kernels": "parkade.kernels"}
# What the user-facing package holds; the services, schemas and kernels never import it.
FRONT = (
    "parkade.engine", "parkade.cli", "parkade.up", "parkade.replica", "parkade.gateway", "parkade.client",
    "parkade.home",
)  # fmt: skip
IO_MODULES = ("aiokafka", "signal", "parkade.services.bus.kafka", "parkade.services.bus.runtime")


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (lazy imports in functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_services_never_import_another_service_nor_the_front_package():
    wrong = []
    for service in SERVICES:
        others = tuple(f"parkade.services.{s}" for s in SERVICES if s != service)
        for path in modules(f"services/{service}"):
            wrong += [f"{path.relative_to(ROOT)} imports {m}" for m in imports(path) if under(m, others)]
    for folder in CODE:
        for path in modules(folder):
            wrong += [f"{path.relative_to(ROOT)} imports {m}" for m in imports(path) if under(m, FRONT)]
    assert not wrong, "\n".join(wrong)


def test_libraries_import_no_service_and_schemas_import_only_schemas():
    wrong = []
    for library in ("services/bus", "services/common", "kernels"):
        for path in modules(library):
            services = tuple(f"parkade.services.{s}" for s in SERVICES)
            wrong += [f"{path.relative_to(ROOT)} imports {m}" for m in imports(path) if under(m, services)]
    for path in modules("schemas"):
        wrong += [
            f"{path.relative_to(ROOT)} imports {m}"
            for m in imports(path)
            if under(m, "parkade") and not under(m, "parkade.schemas")
        ]
    assert not wrong, "\n".join(wrong)


def test_main_is_each_services_only_io_edge():
    wrong = []
    for service in SERVICES:
        folder = ROOT / "services" / service
        assert (folder / "main.py").is_file() and (folder / "handler.py").is_file(), service
        handler = ast.parse((folder / "handler.py").read_text())
        assert any(isinstance(n, ast.ClassDef) and n.name.endswith("Handler") for n in handler.body), service
        for path in modules(f"services/{service}"):
            if path.name == "main.py":
                continue
            source = path.read_text()
            wrong += [f"{path.relative_to(ROOT)} imports {m}" for m in imports(path) if under(m, IO_MODULES)]
            if "os.environ" in source or "os.getenv" in source:
                wrong.append(f"{path.relative_to(ROOT)} reads the environment")
    assert not wrong, "\n".join(wrong)


def test_the_scheduler_core_imports_no_torch_and_no_kafka():
    wrong = [
        f"{path.relative_to(ROOT)} imports {m}"
        for path in modules("services/scheduler")
        for m in imports(path)
        if under(m, ("torch", "aiokafka", "numpy", "parkade.kernels"))
    ]
    assert not wrong, "\n".join(wrong)


def test_nothing_in_the_repository_reaches_outside_it():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    # Spelt in pieces, so that this file does not match itself.
    patterns = ("/".join(["..", "shared"]), "/".join(["shared", "models"]))
    hits = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in (".safetensors", ".bin") or not path.is_file():
            continue
        text = path.read_text(errors="ignore")
        if any(p in text for p in patterns):
            hits.append(name)
    assert not hits, f"files that refer to a folder outside the repository: {hits}"


def test_no_function_in_the_services_is_over_60_lines():
    """A function fits on a screen; one that grows is split into parts with one job each."""
    long = []
    for path in modules("services"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not long, "\n".join(long)
