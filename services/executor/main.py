"""The executor service: `parkade executor --model DIR`. Its only I/O edge."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from parkade.schemas import topics
from parkade.services.bus.base import Bus
from parkade.services.bus.serve import send_all, serve
from parkade.services.engine.args import EngineArgs, build_executor
from parkade.services.executor.service import ExecutorHandler
from parkade.services.runtime import (
    add_bus_arguments,
    announce_ready,
    exit_on_sigterm,
    on_kafka,
    require_bootstrap,
    run_until_signalled,
)

GROUP_ID = "parkade-executor"
HEARTBEAT_S = 5.0


async def run(
    bus: Bus,
    handler: ExecutorHandler,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready=None,
    heartbeat_s: float = HEARTBEAT_S,
) -> None:
    async def on_plan(message, record):
        # The forward pass runs off the event loop, so heartbeats keep going.
        return await asyncio.to_thread(handler.on_plan, message)

    async def heartbeat() -> None:
        while True:
            await send_all(bus, [handler.announcement()], prefix)
            await asyncio.sleep(heartbeat_s)

    beating = asyncio.create_task(heartbeat())
    try:
        await serve(
            bus,
            prefix=prefix,
            group_id=GROUP_ID,
            handlers={topics.STEP_PLANS: on_plan},
            stop=stop,
            ready=ready,
            poll_ms=10,
        )
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating


def build_handler(args: EngineArgs) -> ExecutorHandler:
    model_config, executor, max_model_len = build_executor(args)
    return ExecutorHandler(
        executor, model=str(args.model), max_model_len=max_model_len, eos_token_ids=model_config.eos_token_ids
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parkade executor", description=__doc__)
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bootstrap = require_bootstrap(args, parser)
    exit_on_sigterm()
    handler = build_handler(
        EngineArgs(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_model_len=args.max_model_len,
            attention_backend=args.attention_backend,
            seed=args.seed,
        )
    )

    async def serve_forever(stop: asyncio.Event) -> None:
        await on_kafka(
            bootstrap,
            args.topic_prefix,
            "parkade-executor",
            lambda bus: run(
                bus, handler, prefix=args.topic_prefix, stop=stop, ready=announce_ready("executor")
            ),
        )

    return run_until_signalled(serve_forever)
