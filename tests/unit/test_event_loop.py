"""The services' event loops: uvloop's by default, asyncio's with PARKADE_UVLOOP=0; both run a
service's coroutine to its result, and a `LoopThread` runs on the same kind."""

from __future__ import annotations

import asyncio

import uvloop

from parkade.services.bus import event_loop
from parkade.services.bus.loop_thread import LoopThread


async def loop_kind() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_uvloop_by_default(monkeypatch):
    monkeypatch.delenv("PARKADE_UVLOOP", raising=False)
    assert event_loop.run(loop_kind()) == "uvloop"


def test_asyncio_when_turned_off(monkeypatch):
    monkeypatch.setenv("PARKADE_UVLOOP", "0")
    assert event_loop.run(loop_kind()) == "asyncio"


def test_the_producer_thread_runs_on_the_same_kind(monkeypatch):
    monkeypatch.delenv("PARKADE_UVLOOP", raising=False)
    thread = LoopThread("test-loop")
    try:
        assert isinstance(thread.loop, uvloop.Loop)
        assert asyncio.run(thread.run(loop_kind())) == "uvloop"
    finally:
        thread.close()
