"""The tokenizer service: `parkade tokenizer [--model DIR]`. Its only I/O edge."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from parkade.schemas import ErrorKind, topics
from parkade.services.bus.base import Bus, Outgoing, Record
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import dead_letter, send_all, serve
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.handler import TokenizerHandler, error_event

log = logging.getLogger(__name__)

GROUP_ID = "parkade-tokenizer"
FLAGS = dataclass_flags(TokenizerOptions)


def bad_request(record: Record, error: Exception) -> list[Outgoing]:
    """A request record that cannot be decoded goes to the dead-letter topic; when its request
    id can be read (from the record, else its key), that stream also gets an error event, so that
    a client with a typo gets an answer instead of waiting."""
    out = [dead_letter(record, error)]
    try:
        codec = msgspec.json if topics.is_json(record.header(topics.CONTENT_TYPE)) else msgspec.msgpack
        raw = codec.decode(record.value)
    except msgspec.DecodeError:
        raw = None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    if not (isinstance(request_id, str) and request_id) and record.key:
        request_id = record.key.decode(errors="replace")
    if isinstance(request_id, str) and request_id:
        error_text = f"invalid request: {error}"
        out.append(error_event(request_id, error_text, ErrorKind.INVALID_REQUEST, record.headers))
    return out


async def run(
    bus: Bus,
    handler: TokenizerHandler,
    *,
    prefix: str,
    stop: asyncio.Event,
    ready: Callable[[], None] | None = None,
) -> None:
    await send_all(bus, [handler.announcement()], prefix)  # read back: see TokenizerHandler
    replies_ready: set[str] = set()  # reply topics known to exist

    async def on_request(message, record):
        headers = record.headers
        reply = topics.reply_topic(headers)
        if reply is not None and reply not in replies_ready:
            try:
                await bus.create_topics([reply], single_partition=False)
                if len(replies_ready) > 100_000:
                    replies_ready.clear()
                replies_ready.add(reply)
            except Exception as error:  # a name the broker refuses: answer on the shared topic
                log.warning("reply topic %s could not be created: %s", reply, error)
                headers = tuple(h for h in headers if h[0] != topics.REPLY_TOPIC)
                error_text = f"the reply topic {reply!r} could not be created: {error}"
                request_id = getattr(message, "request_id", "")
                return [error_event(request_id, error_text, ErrorKind.UNAVAILABLE, headers)]
        return handler.on_request(message, headers, (record.topic, record.partition, record.offset))

    await serve(
        bus,
        prefix=prefix,
        group_id=GROUP_ID,
        handlers={
            topics.REQUESTS: on_request,
            topics.GENERATED: lambda message, record: handler.on_generated(message, record.offset),
        },
        after_batch=handler.check_orphans,
        low_watermarks=handler.low_watermarks,
        on_bad_record=lambda record, error: (
            bad_request(record, error)
            if record.topic.endswith(topics.REQUESTS)
            else [dead_letter(record, error)]
        ),
        stop=stop,
        ready=ready,
        on_send_error=handler.on_send_error,
        metrics=handler.metrics,
    )


def build_handler(options: TokenizerOptions) -> TokenizerHandler:
    return TokenizerHandler(FrontEnd.from_options(options))


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("tokenizer", __doc__)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    return run_service(
        "tokenizer", parser, args, lambda: build_handler(TokenizerOptions(**flag_values(FLAGS, args))), run
    )
