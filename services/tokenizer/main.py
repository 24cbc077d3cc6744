"""The tokenizer service: `parkade tokenizer [--model DIR]`. Its only I/O edge."""

from __future__ import annotations

import logging
from typing import Any

from parkade.schemas import AbortRequest, ErrorKind, GenerateRequest, topics
from parkade.services.bus.base import Bus, Outgoing, Record
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import send_all
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.handler import TokenizerHandler, error_event

log = logging.getLogger(__name__)

FLAGS = dataclass_flags(TokenizerOptions)


class TokenizerService(TokenizerHandler):
    """The handler with its I/O: its announcement at start (read back: see TokenizerHandler), and
    each request's reply topic created before the request is handled."""

    def __init__(self, frontend: FrontEnd, **kwargs: Any) -> None:
        super().__init__(frontend, **kwargs)
        self.bus: Bus | None = None  # the one `serve` runs it on
        self.replies_ready: set[str] = set()  # reply topics known to exist

    async def start(self, bus: Bus, prefix: str) -> None:
        self.bus = bus
        await send_all(bus, [self.announcement()], prefix)

    async def on_record(self, message: Any, record: Record) -> list[Outgoing]:
        headers = record.headers
        reply = topics.reply_topic(headers)
        if isinstance(message, GenerateRequest | AbortRequest) and reply and reply not in self.replies_ready:
            assert self.bus is not None, "serve() starts the service first"
            try:
                await self.bus.create_topics([reply], single_partition=False)
            except Exception as error:  # a name the broker refuses: answer on the shared topic
                log.warning("reply topic %s could not be created: %s", reply, error)
                headers = tuple(h for h in headers if h[0] != topics.REPLY_TOPIC)
                error_text = f"the reply topic {reply!r} could not be created: {error}"
                return [error_event(message.request_id, error_text, ErrorKind.UNAVAILABLE, headers)]
            if len(self.replies_ready) > 100_000:
                self.replies_ready.clear()
            self.replies_ready.add(reply)
        return super().on_record(message, record)


def build_service(options: TokenizerOptions) -> TokenizerService:
    return TokenizerService(FrontEnd.from_options(options))


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("tokenizer", __doc__)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)
    return run_service(
        "tokenizer", parser, args, lambda: build_service(TokenizerOptions(**flag_values(FLAGS, args)))
    )
