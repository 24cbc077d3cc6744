"""The tokenizer service: `parkade tokenizer [--model DIR]`. Its only I/O edge."""

from __future__ import annotations

import logging
from typing import Any

from parkade.schemas import AbortRequest, ErrorKind, GenerateRequest, topics
from parkade.services.bus.base import Bus, Outgoing, Record
from parkade.services.bus.runtime import run_service, service_parser
from parkade.services.bus.serve import send_all
from parkade.services.common.flags import Flag, add_flags, dataclass_flags, flag_values
from parkade.services.tokenizer.frontend import FrontEnd, TokenizerOptions
from parkade.services.tokenizer.handler import REPLICA_WAIT_S, TokenizerHandler, error_event
from parkade.services.tokenizer.router import (
    DEFAULT_BALANCE_FACTOR,
    DEFAULT_BALANCE_SLACK,
    DEFAULT_POLICY,
    DEFAULT_REPLICA_TIMEOUT_S,
    POLICIES,
    Router,
)

log = logging.getLogger(__name__)

# The router's settings (router.py), beside the front end's options.
ROUTER_FLAGS = [
    Flag(
        "router",
        str,
        DEFAULT_POLICY,
        "how a request picks its engine replica: kv (fewest uncached prompt blocks plus load, behind a "
        "load gate), round-robin, least-loaded, or session (sticky by the request's session_id)",
        choices=POLICIES,
    ),
    Flag(
        "replica_timeout_s",
        float,
        DEFAULT_REPLICA_TIMEOUT_S,
        "seconds without a replica's status (or with no executor serving it) after which its requests "
        "are handed over to another replica",
    ),
    Flag(
        "replica_wait_s",
        float,
        REPLICA_WAIT_S,
        "seconds a request may wait for a replica to take it before it ends with an error",
    ),
    Flag(
        "balance_factor",
        float,
        DEFAULT_BALANCE_FACTOR,
        "the kv router's load gate: a replica competes while its open requests are within this factor "
        "of the lightest's (plus --balance-slack)",
    ),
    Flag("balance_slack", int, DEFAULT_BALANCE_SLACK, "see --balance-factor"),
]
# Several tokenizers (`parkade up --tokenizers N` gives each its index).
SHARD_FLAGS = [
    Flag("tokenizers", int, 1, "tokenizers sharing the topics, each with the requests of its share of ids"),
    Flag("tokenizer_index", int, 0, "which of the --tokenizers this one is (0 .. N-1)"),
]
FLAGS = [*dataclass_flags(TokenizerOptions), *ROUTER_FLAGS, *SHARD_FLAGS]


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
        if (
            isinstance(message, GenerateRequest | AbortRequest)
            and reply
            and reply not in self.replies_ready
            and self.mine(message.request_id)
        ):
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


def build_service(
    options: TokenizerOptions, *, tokenizers: int = 1, tokenizer_index: int = 0, **router: Any
) -> TokenizerService:
    """The service; `router`: ROUTER_FLAGS' values (ValueError for ones that cannot work)."""
    replica_wait_s = router.pop("replica_wait_s", REPLICA_WAIT_S)
    if replica_wait_s <= 0:
        raise ValueError("replica_wait_s must be > 0")
    policy = Router(router.pop("router", DEFAULT_POLICY), **router)
    return TokenizerService(
        FrontEnd.from_options(options),
        router=policy,
        replica_wait_s=replica_wait_s,
        shard=tokenizer_index,
        shards=tokenizers,
    )


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("tokenizer", __doc__)
    add_flags(parser, FLAGS)
    args = parser.parse_args(argv)

    def build() -> TokenizerService:
        values = flag_values(FLAGS, args)
        router = {flag.name: values.pop(flag.name) for flag in (*ROUTER_FLAGS, *SHARD_FLAGS)}
        return build_service(TokenizerOptions(**values), **router)

    return run_service("tokenizer", parser, args, build)
