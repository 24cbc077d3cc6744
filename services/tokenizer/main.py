"""The tokenizer service: `parkade tokenizer --model DIR`. Its only I/O edge."""

from __future__ import annotations

import argparse
import asyncio

import msgspec

from parkade.schemas import topics
from parkade.services.bus.base import Bus, Record
from parkade.services.bus.serve import dead_letter, serve
from parkade.services.engine.engine import load_tokenizer
from parkade.services.executor.model_config import ModelConfig
from parkade.services.runtime import (
    add_bus_arguments,
    announce_ready,
    exit_on_sigterm,
    on_kafka,
    require_bootstrap,
    run_until_signalled,
)
from parkade.services.tokenizer.service import TokenizerHandler, error_event

GROUP_ID = "parkade-tokenizer"


def bad_request(record: Record, error: Exception) -> list:
    """An invalid request whose id can still be read gets an error event; anything else is a
    dead letter."""
    try:
        raw = msgspec.msgpack.decode(record.value)
    except msgspec.DecodeError:
        return [dead_letter(record, error)]
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    if isinstance(request_id, str) and request_id:
        return [error_event(request_id, f"invalid request: {error}", record.headers)]
    return [dead_letter(record, error)]


async def run(bus: Bus, handler: TokenizerHandler, *, prefix: str, stop: asyncio.Event, ready=None) -> None:
    await serve(
        bus,
        prefix=prefix,
        group_id=GROUP_ID,
        handlers={
            topics.REQUESTS: lambda message, record: handler.on_request(message, record.headers),
            topics.GENERATED: lambda message, record: handler.on_generated(message),
        },
        on_bad_record=lambda record, error: (
            bad_request(record, error)
            if record.topic.endswith(topics.REQUESTS)
            else [dead_letter(record, error)]
        ),
        stop=stop,
        ready=ready,
    )


def make_handler(model: str) -> TokenizerHandler:
    return TokenizerHandler(load_tokenizer(model), ModelConfig.from_pretrained(model).eos_token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="parkade tokenizer", description=__doc__)
    add_bus_arguments(parser)
    parser.add_argument("--model", required=True, help="Hugging Face model folder (its tokenizer)")
    args = parser.parse_args(argv)
    bootstrap = require_bootstrap(args, parser)
    exit_on_sigterm()
    handler = make_handler(args.model)

    async def serve_forever(stop: asyncio.Event) -> None:
        await on_kafka(
            bootstrap,
            args.topic_prefix,
            "parkade-tokenizer",
            lambda bus: run(
                bus, handler, prefix=args.topic_prefix, stop=stop, ready=announce_ready("tokenizer")
            ),
        )

    return run_until_signalled(serve_forever)
