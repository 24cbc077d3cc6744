"""Which event loop each service runs on: the gateway's is uvloop's where it is installed, the
others asyncio's; a SIGTERM stops either kind the same way (`run_until_signalled`)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from parkade.services.bus.runtime import run_until_signalled
from parkade.services.gateway.main import event_loop_factory


def _serve_until_sigterm(loop_factory) -> tuple[int, str]:
    seen: list[str] = []

    async def serve(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__)
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), timeout=10)

    return run_until_signalled(serve, loop_factory), seen[0]


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is not installed on Windows")
def test_the_gateway_runs_on_uvloop_and_stops_on_sigterm():
    factory = event_loop_factory()
    assert factory is not None, "uvloop is a dependency on this platform"
    code, module = _serve_until_sigterm(factory)
    assert code == 0 and module.startswith("uvloop")


def test_the_other_services_run_on_asyncios_loop_and_stop_on_sigterm():
    code, module = _serve_until_sigterm(None)
    assert code == 0 and module.startswith("asyncio")
