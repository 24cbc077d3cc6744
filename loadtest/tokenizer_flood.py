"""A flood of big prompts on the requests topic, then one small request: how long the small one
waits for its answer, with the tokenizer's defences on and off.

    python loadtest/tokenizer_flood.py [--flood 200] [--chars 990000]

Modes (each a fresh pipeline: the three services in this process on the in-memory bus, the
shipped stories260K, 512 tokens of context):
    refused-by-length   as shipped: a prompt its length proves too long is refused untokenized
    aside               no bound by length (as for a tokenizer where none can be proven): each
                        big prompt is tokenized on the worker thread, the small one served meanwhile
    inline              neither: what the tokenizer did before (tokenize each, in turn, then refuse)

Prints one JSON object: per mode, the small request's wait, and when the last flood record was
answered. The broker's hops are not in it (see pipeline_bench.py for those).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from contextlib import asynccontextmanager
from pathlib import Path

from parkade import SamplingParams
from parkade.client import Client
from parkade.models import DEFAULT_MODEL
from parkade.schemas import GenerateRequest, topics
from parkade.services.bus import MemoryBus
from parkade.services.bus.serve import serve
from parkade.services.executor.main import build_service
from parkade.services.executor.options import ExecutorOptions
from parkade.services.scheduler.config import SchedulingOptions
from parkade.services.scheduler.main import SchedulerService
from parkade.services.tokenizer import main as tokenizer_main
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions

PREFIX = "flood."
MODES = ("refused-by-length", "aside", "inline")


@asynccontextmanager
async def pipeline(bus: MemoryBus):
    tokenizer = tokenizer_main.TokenizerService(FrontEnd.from_options(TokenizerOptions()))
    services = (
        tokenizer,
        SchedulerService(SchedulingOptions()),
        build_service(ExecutorOptions(model=DEFAULT_MODEL, dtype="float32"), heartbeat_s=0.5),
    )
    stop, ready = asyncio.Event(), [asyncio.Event() for _ in services]
    tasks = [
        asyncio.create_task(serve(bus, s, prefix=PREFIX, stop=stop, ready=r.set))
        for s, r in zip(services, ready, strict=True)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 60)
        yield tokenizer
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def one_mode(mode: str, flood: int, chars: int) -> dict:
    aside_chars = tokenizer_main.ASIDE_PROMPT_CHARS
    try:
        return await _measure(mode, flood, chars)
    finally:
        tokenizer_main.ASIDE_PROMPT_CHARS = aside_chars


async def _measure(mode: str, flood: int, chars: int) -> dict:
    bus = MemoryBus()
    async with pipeline(bus) as tokenizer, Client(bus=bus, topic_prefix=PREFIX, idle_timeout_s=300) as client:
        if mode != "refused-by-length":
            tokenizer.frontend.token_bound = None
        if mode == "inline":
            tokenizer_main.ASIDE_PROMPT_CHARS = 1 << 62  # (put back by `one_mode`)
        requests = topics.topic_name(topics.REQUESTS, PREFIX)
        words = "Once upon a time, "
        ids = []
        for i in range(flood):
            message = GenerateRequest(request_id=f"flood-{i}", prompt=f"{i} " + words * (chars // len(words)))
            client.expect(message.request_id)
            reply = ((topics.REPLY_TOPIC, client.reply_topic.encode()),)  # its events: to this client
            await bus.send(requests, topics.encode(message), key=message.request_id.encode(), headers=reply)
            ids.append(message.request_id)
        start = time.monotonic()
        params = SamplingParams(temperature=0, max_tokens=4)
        small = [e async for e in client.generate(prompt="Once upon a time", sampling_params=params)]
        small_s = time.monotonic() - start
        answered = [[e async for e in client.stream(i)] for i in ids]
        all_s = time.monotonic() - start
    return {
        "small_request_answered_s": round(small_s, 3),
        "small_request_tokens": sum(len(e.token_ids) for e in small),
        "flood_all_answered_s": round(all_s, 3),
        "flood_refused": sum(1 for ev in answered if ev and ev[-1].error_kind == "invalid_request"),
    }


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "cpu")
    return f"{platform.machine()}, {model}, {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flood", type=int, default=200, help="big prompts first (default: 200)")
    parser.add_argument("--chars", type=int, default=990_000, help="characters each (default: 990000)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"(default: {','.join(MODES)})")
    args = parser.parse_args()
    results = {mode: asyncio.run(one_mode(mode, args.flood, args.chars)) for mode in args.modes.split(",")}
    print(
        json.dumps(
            {
                "flood": args.flood,
                "chars": args.chars,
                "machine": machine(),
                "modes": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
