"""`parkade up` as an operator meets it: every option of every service can be given to it, its
logs are kept per run, its metrics ports are checked before anything starts, and it watches the
embedded broker's memory."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import socket
import subprocess
import sys
import types

import pytest

from parkade import replica, up
from parkade.cli import build_parser
from parkade.services.bus.runtime import service_parser
from parkade.services.common.flags import add_flags
from parkade.services.executor import main as executor_main
from parkade.services.gateway import main as gateway_main
from parkade.services.scheduler import main as scheduler_main
from parkade.services.tokenizer import main as tokenizer_main

MAINS = {
    "tokenizer": tokenizer_main,
    "scheduler": scheduler_main,
    "executor": executor_main,
    "gateway": gateway_main,
    "replica": replica,
}
# The options of a service that `parkade up` sets itself, per child, and why.
SET_BY_UP = {
    "--bootstrap-servers": "its broker (the embedded one, or $KAFKA_BOOTSTRAP_SERVERS)",
    "--replica": "each replica's (or scheduler's and executor's) replica, 0..--replicas - 1",
    "--tokenizer-index": "each tokenizer's index, 0..--tokenizers - 1",
}


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    for name in ("PARKADE_METRICS_PORT", "PARKADE_API_KEY", "PARKADE_KAFKA_IDEMPOTENCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PARKADE_HOME", str(tmp_path / "home"))


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def _service_parser(main, monkeypatch) -> argparse.ArgumentParser:
    """The parser a service's `main` builds: caught where it parses."""

    def caught(self, *_args, **_kwargs):
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", caught)
        with pytest.raises(_Parsed) as parsed:
            main([])
    return parsed.value.parser


def _up_parser() -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices["up"]


@pytest.mark.parametrize("name", list(MAINS))
def test_every_option_of_every_service_is_an_option_of_parkade_up(name, monkeypatch):
    """What `parkade <service>` takes, `parkade up` takes too (or up sets it)."""
    service = _options(_service_parser(MAINS[name].main, monkeypatch)) - {"--help"}
    assert "--metrics-port" in service  # (the parse works: each service has its bus options)
    missing = service - _options(_up_parser()) - set(SET_BY_UP)
    assert not missing, f"options of `parkade {name}` that `parkade up` does not take: {sorted(missing)}"


def test_the_bus_options_reach_every_service_and_the_key_goes_by_the_environment():
    args = build_parser().parse_args(["up", "--idempotence", "--broker-wait", "3.5", "--api-key", "k1"])
    for name in ("tokenizer", "scheduler", "executor", "replica"):
        parser = service_parser(name, None, replica=name != "tokenizer")
        add_flags(parser, MAINS[name].FLAGS)
        parsed = parser.parse_args(["--bootstrap-servers", "x:1", *up.service_argv(name, args)])
        assert parsed.idempotence and parsed.broker_wait == 3.5, name
    # NOTE: never on a command line, which any user of the machine can read (ps, /proc).
    assert all("k1" not in up.service_argv(name, args) for name in MAINS)
    defaults = build_parser().parse_args(["up"])
    assert all(up.service_argv(name, defaults) == [] for name in MAINS)


def test_a_metrics_port_range_in_use_is_refused_before_anything_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # 1 tokenizer + 2 split replicas (a scheduler and an executor each) + the gateway: 6 ports
        split = ["up", "--replicas", "2", "--split-replicas", "--split-tokenizer", "--metrics-port"]
        problem = up.check(build_parser().parse_args([*split, str(port - 5)]))
        # 2 replicas of one process each + the gateway with the tokenizer: 3 ports
        one = up.check(build_parser().parse_args(["up", "--replicas", "2", "--metrics-port", str(port - 2)]))
        # 2 tokenizers (always apart) + 1 replica + the gateway: 4 ports
        two = ["up", "--tokenizers", "2", "--metrics-port", str(port - 3)]
        tokenizers = up.check(build_parser().parse_args(two))
    assert problem is not None and problem.startswith(f"metrics port {port} is in use")
    assert f"--metrics-port {port - 5} takes 6 ports" in problem
    assert one is not None and f"--metrics-port {port - 2} takes 3 ports" in one
    assert tokenizers is not None and f"--metrics-port {port - 3} takes 4 ports" in tokenizers


def test_each_run_has_its_own_log_folder_and_the_oldest_are_removed(tmp_path, monkeypatch):
    root = tmp_path / "logs"
    (root).mkdir()
    (root / "tokenizer.log").write_text("a log of an older Parkade: left alone")
    stamps = iter(f"20261204-1100{s:02d}" for s in (1, 2, 2, 3, 4))
    monkeypatch.setattr(up.time, "strftime", lambda _fmt: next(stamps))
    runs = [up.new_log_dir(root, keep=3) for _ in range(5)]
    assert [r.name for r in runs] == [
        "20261204-110001",
        "20261204-110002",
        "20261204-110002.1",  # two starts in one second: two folders
        "20261204-110003",
        "20261204-110004",
    ]
    assert sorted(p.name for p in root.iterdir()) == [
        "20261204-110002.1",
        "20261204-110003",
        "20261204-110004",
        "latest",
        "tokenizer.log",
    ]
    assert (root / "latest").resolve() == runs[-1].resolve() and os.readlink(root / "latest") == runs[-1].name


def test_the_embedded_brokers_memory_is_reported_and_warned_of_at_each_doubling(monkeypatch, capsys):
    sizes = iter([100.0, 300.0, 350.0, 700.0, 1500.0])
    monkeypatch.setattr(up, "resident_mb", lambda _pid: next(sizes))
    monkeypatch.setattr(up, "BROKER_MEMORY_POLL_S", 0.0)
    written = []
    monkeypatch.setattr(up, "write_state", lambda state: written.append(state["broker_memory_mb"]))
    broker = types.SimpleNamespace(proc=types.SimpleNamespace(pid=1))

    async def watch() -> None:
        with contextlib.suppress(StopIteration, RuntimeError):
            await up._watch_broker_memory(broker, 256.0, {})

    asyncio.run(watch())
    assert written == [100, 300, 350, 700, 1500]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    # 300 passes 256 (next: 512), 700 passes 512 (next: 1024), 1500 passes 1024 (next: 2048)
    assert [w.split(" holds ")[1].split(" MB")[0] for w in warnings] == ["300", "700", "1,500"]
    assert "KAFKA_BOOTSTRAP_SERVERS=host:port parkade up" in warnings[0]
    assert warnings[-1].endswith("Next warning at 2,048 MB")


def test_resident_memory_of_this_process_is_read():
    assert 1 < up.resident_mb(os.getpid()) < 64 * 1024
    assert up.resident_mb(2**22 + 12345) is None  # no such process


def test_the_banner_lists_metrics_the_key_header_and_a_runnable_parkade(tmp_path, capsys, monkeypatch):
    args = build_parser().parse_args(["up", "--api-key", "k1", "--trace"])
    metrics = {"tokenizer": "http://127.0.0.1:9100/metrics", "gateway": "http://127.0.0.1:9101/metrics"}
    monkeypatch.setattr(up.shutil, "which", lambda _name: None)  # a venv that is not activated
    up._print_instructions(args, "127.0.0.1:1234", tmp_path / "logs" / "run", "http://h:1/v1", metrics, True)
    out = capsys.readouterr().out
    assert f"{os.path.join(sys.prefix, 'bin', 'parkade')}" in out or ".venv/bin/parkade generate" in out
    assert '-H "Authorization: Bearer $PARKADE_API_KEY"' in out and "k1" not in out
    assert (
        "Metrics (Prometheus): tokenizer http://127.0.0.1:9100/metrics, gateway http://127.0.0.1:9101" in out
    )
    assert "shows one request's timeline." in out
    assert "keeps every record in memory" in out


def test_up_help_says_where_its_files_are_and_what_the_broker_keeps():
    text = _up_parser().format_help()
    assert "~/.cache/parkade" in text and "logs/latest" in text and "--metrics-port" in text
    assert "--api-key" in text and "keeps every record in memory" in text


def test_parser_of_up_has_no_option_twice():
    parser = _up_parser()
    strings = [s for action in parser._actions for s in action.option_strings]
    assert len(strings) == len(set(strings))
    assert isinstance(parser, argparse.ArgumentParser)


@pytest.mark.parametrize("name", list(MAINS))
def test_a_services_help_keeps_its_descriptions_layout(name, monkeypatch):
    """Each service's --help shows its module docstring as written (lists and tables), not as
    one run-on paragraph."""
    text = _service_parser(MAINS[name].main, monkeypatch).format_help()
    doc = MAINS[name].__doc__
    indented = [line for line in doc.splitlines() if line.startswith("    ") and line.strip()]
    assert doc.splitlines()[0] in text
    assert all(line in text for line in indented), name


def test_a_clock_set_back_never_removes_this_runs_logs(tmp_path, monkeypatch):
    root = tmp_path / "logs"
    stamps = iter(["20261204-120000", "20261204-120001", "20261204-110000"])  # then an hour back
    monkeypatch.setattr(up.time, "strftime", lambda _fmt: next(stamps))
    runs = [up.new_log_dir(root, keep=2) for _ in range(3)]
    assert runs[-1].exists() and (root / "latest").resolve() == runs[-1].resolve()
    kept = sorted(p.name for p in root.iterdir() if p.name != "latest")
    assert kept == ["20261204-110000", "20261204-120001"]


def test_metrics_ports_that_cannot_work_are_refused_before_anything_starts(monkeypatch):
    parse = build_parser().parse_args
    problem = up.check(parse(["up", "--metrics-port", "9100", "--http-port", "9101"]))
    assert problem == "--metrics-port 9100 takes 2 ports, --http-port 9101 among them"
    monkeypatch.setenv("PARKADE_METRICS_PORT", "nine")
    args = parse(["up"])  # (the parser still builds: every command works)
    assert up.check(args) == "PARKADE_METRICS_PORT='nine' is not a port number"


def test_a_pipeline_nice_outside_0_to_19_is_refused():
    parse = build_parser().parse_args
    assert up.check(parse(["up", "--pipeline-nice", "-5"])).startswith("--pipeline-nice must be 0-19")
    assert up.check(parse(["up", "--pipeline-nice", "20"])).startswith("--pipeline-nice must be 0-19")
    assert up.check(parse(["up", "--pipeline-nice", "10"])) is None


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's scheduling policies")
@pytest.mark.parametrize(
    ("flags", "policy"), [([], "SCHED_BATCH"), (["--pipeline-policy", "normal"], "SCHED_OTHER")]
)
def test_the_pipeline_policy_is_what_a_child_runs_under(flags, policy):
    # What `parkade up` does before a pipeline child's exec, seen from such a child and its threads.
    args = build_parser().parse_args(["up", *flags])
    probe = "import os, threading; t = threading.Thread(target=lambda: print(os.sched_getscheduler(0)))"
    probe += "; t.start(); t.join(); print(os.sched_getscheduler(0), os.nice(0))"
    child = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=functools.partial(up._in_child, 3, args.pipeline_policy == "batch"),
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    expected = getattr(os, policy)
    assert child.stdout.split() == [str(expected), str(expected), str(os.nice(0) + 3)]
