"""`parkade.client`: submit requests to a running Parkade and stream their tokens.

    async with Client() as client:   # the broker of $KAFKA_BOOTSTRAP_SERVERS or `parkade up`
        async for event in client.generate(prompt="Once upon a time", sampling_params=params):
            print(event.text, end="")

The client reads the tokens topic itself (no consumer group: every client sees every event and
keeps those of its own requests), starting from its end before it sends anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from parkade import home
from parkade.schemas import AbortRequest, ChatMessage, GenerateRequest, SamplingParams, TokenEvent, topics
from parkade.services.bus.base import Bus, Outgoing
from parkade.services.bus.serve import send_all


class NoBrokerError(RuntimeError):
    """No broker was given and none could be found."""


def find_broker(bootstrap_servers: str | None = None, topic_prefix: str | None = None) -> tuple[str, str]:
    """(bootstrap servers, topic prefix) of the Parkade to talk to: the ones given, else
    $KAFKA_BOOTSTRAP_SERVERS, else those of the `parkade up` running on this machine.

    Raises NoBrokerError when there is none."""
    bootstrap = bootstrap_servers or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if bootstrap:
        return bootstrap, topic_prefix or topics.DEFAULT_PREFIX
    state = home.read_state()
    if state is None:
        raise NoBrokerError(
            "no broker: start one with `parkade up`, or pass bootstrap servers (--bootstrap-servers) "
            "or set KAFKA_BOOTSTRAP_SERVERS"
        )
    return state["bootstrap_servers"], topic_prefix or state["topic_prefix"]


def new_traceparent() -> bytes:
    """A W3C trace context for a new request (version 00, sampled)."""
    return f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01".encode()


class Client:
    def __init__(
        self,
        bootstrap_servers: str | None = None,
        topic_prefix: str | None = None,
        *,
        bus: Bus | None = None,
    ) -> None:
        """Talk to the broker `bootstrap_servers` (default: see `find_broker`), or over `bus`."""
        if bus is None:
            from parkade.services.bus.kafka import KafkaBus

            bootstrap_servers, topic_prefix = find_broker(bootstrap_servers, topic_prefix)
            bus = KafkaBus(bootstrap_servers, client_id="parkade-client")
        self.bus = bus
        self.bootstrap_servers = bootstrap_servers
        self.prefix = topic_prefix or topics.DEFAULT_PREFIX
        self._streams: dict[str, asyncio.Queue[TokenEvent | BaseException]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._decoder = topics.decoder(topics.TOKENS)

    async def start(self) -> None:
        consumer = await self.bus.consumer(
            [topics.topic_name(topics.TOKENS, self.prefix)], None, from_end=True
        )
        self._reader = asyncio.create_task(self._read(consumer))

    async def _read(self, consumer: Any) -> None:
        try:
            while True:
                for record in await consumer.getmany(timeout_ms=100):
                    try:
                        event = self._decoder.decode(record.value)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        continue  # not ours to judge: the services write this topic
                    queue = self._streams.get(event.request_id)
                    if queue is not None:
                        queue.put_nowait(event)
        except Exception as error:  # a broken connection ends every open stream, never a hang
            for queue in self._streams.values():
                queue.put_nowait(error)
            raise
        finally:
            await consumer.stop()

    async def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self.bus.close()

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def submit(
        self,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Send a generate request; its events are kept for `stream(request_id)`."""
        assert self._reader is not None, "start the client first (async with Client(...))"
        request = GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            prompt_token_ids=tuple(prompt_token_ids) if prompt_token_ids is not None else None,
            messages=tuple(ChatMessage(**m) for m in messages) if messages is not None else None,
            sampling_params=sampling_params or SamplingParams(),
            priority=priority,
        )
        self._streams[request.request_id] = asyncio.Queue()
        headers = (("traceparent", new_traceparent()),)
        await send_all(
            self.bus, [Outgoing(topics.REQUESTS, request, request.request_id, headers)], self.prefix
        )
        return request.request_id

    async def stream(self, request_id: str) -> AsyncIterator[TokenEvent]:
        """The request's events, in order, until the one with a finish_reason. Leaving early
        (break, cancellation) aborts the request, as vLLM's streaming APIs do."""
        queue = self._streams[request_id]
        finished = False
        next_index = 0
        try:
            while not finished:
                event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if event.token_ids and event.index < next_index:
                    continue  # a duplicate (at-least-once delivery)
                next_index = event.index + len(event.token_ids)
                finished = event.finish_reason is not None
                yield event
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self.cancel(request_id)

    async def generate(self, **kwargs: Any) -> AsyncIterator[TokenEvent]:
        """`submit` then `stream`: same arguments as `submit`."""
        request_id = await self.submit(**kwargs)
        async for event in self.stream(request_id):
            yield event

    async def cancel(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        await send_all(
            self.bus,
            [Outgoing(topics.REQUESTS, AbortRequest(request_id=request_id), request_id)],
            self.prefix,
        )
