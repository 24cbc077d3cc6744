"""The command line as a new user meets it: the same generation flags and defaults for `offline`
and `generate`, defaults and choices in every --help, and one clear line (no traceback) for a bad
setting, a model folder that lacks a file, a port in use, or a broker that is not there."""

from __future__ import annotations

import shutil
import socket

import pytest

from parkade import DEFAULT_MODEL, up
from parkade.cli import GENERATION_FLAGS, build_parser, main
from parkade.client import Client, NoBrokerError, find_broker
from parkade.home import write_state
from parkade.services.common.flags import flag_values


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """No broker in the environment and no running `parkade up` to find."""
    monkeypatch.delenv("KAFKA_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("PARKADE_HOME", str(tmp_path / "home"))


def test_offline_and_generate_take_the_same_generation_flags_and_defaults():
    parser = build_parser()
    offline = flag_values(GENERATION_FLAGS, parser.parse_args(["offline", "hi"]))
    generate = flag_values(GENERATION_FLAGS, parser.parse_args(["generate", "hi"]))
    assert offline == generate
    assert offline["temperature"] == 1.0 and offline["max_tokens"] == 64
    argv = ["--top-p", "0.5", "--top-k", "3", "--seed", "7", "--stop", "x", "--stop", "y", "--ignore-eos"]
    for command in ("offline", "generate"):
        values = flag_values(GENERATION_FLAGS, parser.parse_args([command, "hi", *argv]))
        assert (values["top_p"], values["top_k"], values["seed"]) == (0.5, 3, 7)
        assert values["stop"] == ("x", "y") and values["ignore_eos"] is True


def _help(*argv: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return ""


@pytest.mark.parametrize("command", ["offline", "generate", "up"])
def test_every_help_shows_defaults_and_choices(command, capsys):
    _help(command)
    text = " ".join(capsys.readouterr().out.split())
    if command != "up":
        assert "0: greedy (default: 1.0)" in text and "most tokens to generate (default: 64)" in text
    if command != "generate":
        assert "{auto,float32,float,bfloat16,float16,half}" in text
        assert "--device {auto,cpu,cuda}" in text and "--attention-backend {auto,triton,cpu,torch}" in text
        assert (
            "--scheduling-policy {fcfs,priority}" in text
            and "(default: stories260K, shipped with Parkade)" in text
        )


@pytest.mark.parametrize("command", ["offline", "generate"])
def test_a_bad_generation_flag_is_one_line(command, capsys):
    assert main([command, "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == f"parkade {command}: temperature must be >= 0, got -1.0\n"


def _folder_without_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "tokenizer.json").unlink()
    return folder


@pytest.mark.parametrize("command", ["offline", "up"])
def test_a_model_folder_that_lacks_a_file_is_named_in_one_line(command, tmp_path, capsys):
    prompt = ["hi"] if command == "offline" else []
    folder = _folder_without_tokenizer(tmp_path)
    assert main([command, *prompt, "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"parkade {command}: ") and "no tokenizer.json" in err and err.count("\n") == 1
    assert main([command, *prompt, "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "no model folder at" in err and "no model hub" in err
    assert main([command, *prompt, "--model", str(folder), "--tokenizer", str(tmp_path / "missing")]) == 2
    assert f"no model folder at {tmp_path / 'missing'}" in capsys.readouterr().err
    (folder / "model.safetensors").unlink()
    assert main([command, *prompt, "--model", str(folder), "--tokenizer", str(DEFAULT_MODEL)]) == 2
    assert "has no safetensors weights" in capsys.readouterr().err
    (folder / "config.json").unlink()
    assert main([command, *prompt, "--model", str(folder), "--tokenizer", str(DEFAULT_MODEL)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_up_refuses_a_port_in_use_before_starting_anything(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is in use" in err
    assert not (tmp_path / "home" / "logs").exists()  # nothing was started


def test_up_refuses_settings_that_cannot_work(capsys):
    assert main(["up", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err == "parkade up: max_num_seqs must be >= 1, got 0\n"
    assert main(["up", "--max-in-flight", "0"]) == 2
    assert capsys.readouterr().err == "parkade up: max_in_flight must be >= 1, got 0\n"
    # As `LLM(...)` refuses it before loading weights (stories260K: 512 positions).
    no_chunks = ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "256"]
    assert main(["up", *no_chunks]) == 2
    assert "max_num_batched_tokens (256) must be >= max_model_len (512)" in capsys.readouterr().err
    parse = build_parser().parse_args
    assert up.check(parse(["up", *no_chunks, "--max-model-len", "256", "--http-port", "0"])) is None
    with socket.socket() as taken:  # the gateway's port, taken: refused before anything starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        problem = up.check(parse(["up", "--http-port", port]))
    assert problem == f"HTTP port {port} on 127.0.0.1 is in use: pass another --http-port (0: a free one)"


def test_up_says_in_one_line_that_the_given_broker_does_not_answer(monkeypatch, capsys):
    with socket.socket() as s:  # a free port: nothing answers there
        s.bind(("127.0.0.1", 0))
        bootstrap = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", bootstrap)
    assert main(["up", "--broker-wait", "0.5", "--http-port", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"parkade up: cannot reach the broker at {bootstrap} ($KAFKA_BOOTSTRAP_SERVERS)")


def test_generate_without_a_broker_says_how_to_get_one(capsys):
    assert main(["generate", "hi"]) == 2
    assert "no broker: start one with `parkade up`" in capsys.readouterr().err


def test_client_finds_the_broker_as_parkade_generate_does(monkeypatch):
    with pytest.raises(NoBrokerError):
        Client()
    import os

    write_state({"pid": os.getpid(), "bootstrap_servers": "127.0.0.1:1234", "topic_prefix": "p."})
    client = Client()
    assert (client.bootstrap_servers, client.prefix) == ("127.0.0.1:1234", "p.")
    assert find_broker(topic_prefix="q.") == ("127.0.0.1:1234", "q.")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "kafka:9092")
    client = Client()
    assert (client.bootstrap_servers, client.prefix) == ("kafka:9092", "parkade.")
    assert Client("other:1", "x.").bootstrap_servers == "other:1"


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"parkade {version('parkade')}\n"


def test_the_top_level_help_names_every_process_up_runs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "tokenizer, scheduler, executor and the gateway" in text
    assert "parkade --version" in text


def _unreachable() -> str:
    with socket.socket() as s:  # a free port: nothing answers there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("argv", [["topics"], ["topics", "--create"], ["topics", "--reap"]])
def test_topics_finds_the_broker_as_generate_does(argv, monkeypatch, capsys):
    import os

    assert main(argv) == 2
    assert "no broker: start one with `parkade up`" in capsys.readouterr().err
    up_broker = _unreachable()
    write_state({"pid": os.getpid(), "bootstrap_servers": up_broker, "topic_prefix": "p."})
    assert main([*argv, "--broker-wait", "0.3"]) == 1
    assert capsys.readouterr().err.startswith(f"parkade topics: cannot reach the broker at {up_broker}")
    env_broker = _unreachable()
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", env_broker)
    assert main([*argv, "--broker-wait", "0.3"]) == 1
    assert f"cannot reach the broker at {env_broker}" in capsys.readouterr().err
