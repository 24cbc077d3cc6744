"""The tokenizer service: `parkade tokenizer [--model DIR]`. Its only I/O edge.

Large prompts are tokenized aside: a text prompt of over `ASIDE_PROMPT_CHARS` characters goes to
a worker thread (the tokenizers library lets go of the GIL while it encodes: 0.7 s a megabyte
here), and the records behind it are served meanwhile; once its ids are there (`after_batch`),
the request opens as any other. Until then it holds the requests topic's commit at its record
(`low_watermarks`): a crash reads it again. The records about it that come meanwhile (an abort,
the same id again) wait for it and follow it in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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

# A text prompt longer than this is tokenized on the worker thread (see the module): a few ms
# inline at most. Beyond `MAX_ASIDE` prompts aside, the next waits for the oldest (a bound on the
# prompts held in memory).
ASIDE_PROMPT_CHARS = 16_384
MAX_ASIDE = 32


@dataclass
class _Aside:
    """A request whose prompt a worker thread tokenizes."""

    message: GenerateRequest
    record: Record
    token_ids: asyncio.Future[list[int]]
    # The generated topic's position when its record was read (None: below the next record read),
    # held as an open stream's is: the events of a request that comes and ends while this one is
    # aside must be read again after a restart, as this one's record is (found by review).
    generated_start: int | None
    behind: list[tuple[Any, Record]] = field(default_factory=list)  # its records that came since


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
        self.aside: dict[str, _Aside] = {}  # by request id, in arrival order
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parkade-tokenize")

    async def start(self, bus: Bus, prefix: str) -> None:
        self.bus = bus
        await send_all(bus, [self.announcement()], prefix)

    async def stop(self) -> None:
        # What is aside is read again after a restart (its commit was held).
        self._worker.shutdown(wait=False, cancel_futures=True)
        await super().stop()

    def busy(self) -> bool:
        return super().busy() or bool(self.aside)  # (short fetch waits: `after_batch` comes soon)

    def after_batch(self) -> list[Outgoing]:
        out: list[Outgoing] = []
        for request_id, aside in list(self.aside.items()):
            if aside.token_ids.done():
                del self.aside[request_id]
                out += self._open_aside(aside)
        return out + super().after_batch()

    def low_watermarks(self) -> dict[str, int]:
        out = super().low_watermarks()
        aside = [
            a.record.offset for a in self.aside.values() if not topics.is_gateway_requests(a.record.topic)
        ]
        if aside:  # (the records behind one come after it)
            oldest = min(aside)
            out[topics.REQUESTS] = min(out.get(topics.REQUESTS, oldest), oldest)
        starts = [a.generated_start for a in self.aside.values() if a.generated_start is not None]
        if starts:
            out[topics.GENERATED] = min(out.get(topics.GENERATED, min(starts)), min(starts))
        return out

    def _goes_aside(self, message: GenerateRequest) -> bool:
        # NOTE: not while reading a predecessor's log again: its requests must be known by the
        # time its own announcement is read (see handler.py), so those are tokenized inline.
        return (
            message.prompt is not None
            and message.prompt_token_ids is None
            and message.messages is None
            and len(message.prompt) > ASIDE_PROMPT_CHARS
            and self.caught_up_at is not None
            and self.frontend.tokenizer is not None
            and self.mine(message.request_id)
        )

    async def _put_aside(self, message: GenerateRequest, record: Record) -> list[Outgoing]:
        source = (record.topic, record.partition, record.offset)
        refused = self._refused_before_tokenizing(message, record.headers, source)
        if refused is not None:
            return refused
        # A prompt too long by its length alone is refused here, at the cost of a len().
        truncate = message.sampling_params.truncate_prompt_tokens
        try:
            self.frontend.refuse_by_length(message.prompt, truncate)
        except ValueError as error:
            return self.open_tokenized(message, record.headers, source, error)
        # NOTE: the ones not tokenized yet count: finished ones wait for `after_batch` to leave.
        while (
            len(working := [a.token_ids for a in self.aside.values() if not a.token_ids.done()]) >= MAX_ASIDE
        ):
            await asyncio.wait(working, return_when=asyncio.FIRST_COMPLETED)
        tokenize = functools.partial(self.frontend.prompt_token_ids, message.prompt, truncate=truncate)
        future = asyncio.get_running_loop().run_in_executor(self._worker, tokenize)
        self.aside[message.request_id] = _Aside(message, record, future, self.generated_position)
        return []

    def _open_aside(self, aside: _Aside) -> list[Outgoing]:
        """Its stream (or its error event), then the records that waited behind it."""
        record = aside.record
        error = aside.token_ids.exception()
        out = self.open_tokenized(
            aside.message,
            record.headers,
            (record.topic, record.partition, record.offset),
            error if error is not None else aside.token_ids.result(),
            generated_start=aside.generated_start,
        )
        for message, behind in aside.behind:
            out += super().on_record(message, behind)
        return out

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
        if self.aside and self.generated_position is None and record.topic.endswith(topics.GENERATED):
            for aside in self.aside.values():  # as the handler does for open streams
                if aside.generated_start is None:
                    aside.generated_start = record.offset
        if isinstance(message, GenerateRequest | AbortRequest) and message.request_id in self.aside:
            aside = self.aside[message.request_id]
            if aside.record.offset != record.offset or aside.record.topic != record.topic:
                aside.behind.append((message, record))  # (else: the same record, redelivered)
            return []
        if isinstance(message, GenerateRequest) and self._goes_aside(message):
            return await self._put_aside(message, record)
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
