"""The services' event loops: uvloop's where it is installed, asyncio's otherwise.

Why: the pipeline's CPU, not the model's, decides an online burst's first tokens on a small
machine (docs/benchmarks.md, thirteenth session: the broker, the gateway, the scheduler and the
tokenizer took 4.4-4.7 CPU seconds of a timed round against the executor's 2.9), and much of the
Python services' part is the event loop running aiokafka's and uvicorn's callbacks. uvloop (libuv,
in C; vLLM's API server runs on it) runs them with less: measured on `parkade up` under vLLM's
client (tiny-llama, 64 streams, four rounds each, alternated), the gateway, scheduler and
tokenizer took 0.86 of the executor's CPU against 0.89 on asyncio's loop. Small, and free.

PARKADE_UVLOOP=0 keeps asyncio's loop (to compare, or where uvloop misbehaves).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a service's event loop: uvloop's unless PARKADE_UVLOOP=0 or it is missing."""
    if os.environ.get("PARKADE_UVLOOP", "1") != "0":
        try:
            import uvloop
        except ImportError:  # a platform without uvloop's wheel (Windows): asyncio's loop serves
            pass
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the services' event loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
