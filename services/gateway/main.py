"""The gateway service: `parkade gateway [--http-port 8000]`, the OpenAI HTTP API over the Kafka
pipeline. Its only I/O edge (HTTP, Kafka, signals, environment).

    POST /v1/completions, /v1/chat/completions   streaming (SSE) or not
    GET  /v1/models
    GET  /health     200 once the broker answers and the tokenizer, scheduler and executor
                     heartbeat (the instances topic); 503 naming what is missing
    GET  /metrics    the gateway's own counters and histograms (Prometheus text)

A Kafka client like any other: one `RequestClient` for all of its HTTP requests, with a reply
topic of its own (in memory where the tokenizer runs in this process: `serve`'s `beside`, which
`parkade gateway --with-tokenizer` gives it, see parkade/gateway.py). A request's status comes
from its first event, so a request the pipeline refuses is answered with a status (400 invalid,
429 overloaded, 503 unavailable, 500 failed) even when it asked for a stream; an error after the
first token ends the stream with an error chunk. A client that disconnects aborts its request,
which frees its KV blocks.

`--api-key` (or $PARKADE_API_KEY) guards `/v1/*` with a bearer token, as vLLM's server does;
`/health` and `/metrics` stay open.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
import msgspec
import uvicorn
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from parkade.schemas import FinishReason, InstanceHeartbeat, ReplicaStatus, TokenEvent, topics
from parkade.services import PIPELINE
from parkade.services.bus import replies
from parkade.services.bus.base import Bus, RecordRejected
from parkade.services.bus.client import PipelineGoneError, RequestClient
from parkade.services.bus.runtime import connection_settings_ok, service_parser
from parkade.services.bus.serve import Service
from parkade.services.bus.split import SplitBus
from parkade.services.common import logs, tracing
from parkade.services.common.flags import add_flags, dataclass_flags, flag_values
from parkade.services.common.heap import freeze_startup_heap
from parkade.services.gateway.handler import GatewayHandler, GatewayOptions, Opened
from parkade.services.gateway.metrics import GatewayMetrics
from parkade.services.gateway.protocol import GatewayError, joined, joins, pipeline_error
from parkade.services.gateway.sse import EventStream

log = logging.getLogger(__name__)
T = TypeVar("T")

FLAGS = dataclass_flags(GatewayOptions)
# A service is alive while its heartbeats (one a second) keep coming.
HEARTBEAT_STALE_S = 5.0
SEND_TIMEOUT_S = 30.0
PING_S = 15.0  # a quiet stream's keep-alive comment, for proxies
# At a stop, open requests get this long to end; then their streams are cut (and aborted).
GRACEFUL_STOP_S = 3.0
BROKER_PROBE_S = 2.0
# The broker's fetch wait of the heartbeat reader: /health needs a heartbeat within seconds, not
# milliseconds, and the bus's default (20 ms) had it fetch 50 times a second, idle or not.
HEALTH_FETCH_WAIT_MS = 500


class ClientGone(Exception):
    """The HTTP client disconnected before its answer started."""


class Health:
    """What `/health` reports: the services' last heartbeats and whether the broker answers."""

    def __init__(self, client: RequestClient) -> None:
        self.client = client
        self.last_heartbeat: dict[str, float] = {}
        # Each engine replica's last status (the kv-events topic), and when it was read.
        self.replicas: dict[str, tuple[ReplicaStatus, float]] = {}
        self._broker_checked = (-1e9, False)

    async def follow(self) -> None:
        """Read heartbeats from the instances topic and the replicas' statuses from the kv-events
        topic, from their ends, until cancelled."""
        bus = self.client.bus
        decoders = {
            topics.topic_name(t, self.client.prefix): topics.TopicDecoder(t)
            for t in (topics.INSTANCES, topics.KV_EVENTS)
        }
        consumer = await bus.consumer(list(decoders), None, from_end=True)
        consumer.set_fetch_wait(HEALTH_FETCH_WAIT_MS)
        try:
            while True:
                try:
                    records = await consumer.getmany(timeout_ms=500)
                except Exception as error:  # the broker's trouble: /health says so meanwhile
                    log.warning("reading heartbeats: %s", error)
                    await asyncio.sleep(1.0)
                    continue
                for record in records:
                    with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, KeyError):
                        decoder = decoders[record.topic]
                        message = decoder.decode(record.value, record.header(topics.CONTENT_TYPE))
                        if isinstance(message, InstanceHeartbeat):
                            # Any replica's scheduler (`scheduler.replica-R`) is a scheduler.
                            self.last_heartbeat[message.service.split(".")[0]] = time.monotonic()
                        elif isinstance(message, ReplicaStatus):
                            self.replicas[message.replica] = (message, time.monotonic())
        finally:
            with contextlib.suppress(Exception):
                await consumer.stop()

    async def report(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        checked_at, broker_ok = self._broker_checked
        if now - checked_at > 1.0:  # one probe a second at most, however often /health is asked
            try:
                await self.client.bus.ping(timeout_s=BROKER_PROBE_S)
                broker_ok = True
            except Exception:
                broker_ok = False
            self._broker_checked = (now, broker_ok)
        missing = [s for s in PIPELINE if now - self.last_heartbeat.get(s, -1e9) > HEARTBEAT_STALE_S]
        replicas = {
            name: _replica_health(status, now - heard) for name, (status, heard) in self.replicas.items()
        }
        # NOTE: and a replica that serves (its scheduler consumes, an executor joined it): the
        # services heartbeat from before they consume, and a request sent in between waited for
        # their start (measured: 1.1-1.5 s for the first request after `ok`, then 21-47 ms).
        ok = broker_ok and not missing and any(r["serving"] for r in replicas.values())
        detail = {
            "status": "ok" if ok else "unavailable",
            "broker": broker_ok,
            "services_missing": missing,
            "replicas": replicas,
        }
        return ok, detail


class _ReplicaGauges(Collector):
    """Every engine replica in the gateway's /metrics, as /health shows it (read from the HTTP
    server's task: the dict is copied first)."""

    FIELDS = (
        ("serving", "1 while the replica serves (its status is fresh and an executor serves it)"),
        ("requests_running", "requests running there, as its last status said"),
        ("requests_waiting", "requests waiting there, as its last status said"),
        ("kv_cache_usage", "used blocks / all blocks of its pool, 0 to 1"),
        ("prefix_hit_rate", "prompt tokens found in its prefix cache, 0 to 1"),
    )

    def __init__(self, health: Health) -> None:
        self.health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = time.monotonic()
        replicas = {
            name: _replica_health(s, now - at) for name, (s, at) in list(self.health.replicas.items())
        }
        for field, doc in self.FIELDS:
            family = GaugeMetricFamily(f"parkade:replica_{field}", doc, labels=["replica"])
            for name, values in replicas.items():
                family.add_metric([name], float(values[field]))
            yield family


def _replica_health(status: ReplicaStatus, age_s: float) -> dict[str, Any]:
    """One replica in `/health`: what its last status said (serving only while it is fresh)."""
    fresh = age_s <= HEARTBEAT_STALE_S and not status.draining
    used = status.num_blocks - status.num_free_blocks
    return {
        "serving": fresh and status.serving,
        "draining": status.draining,
        "last_status_s": round(age_s, 1),
        "requests_running": status.num_running,
        "requests_waiting": status.num_waiting,
        "kv_cache_usage": round(used / status.num_blocks, 4) if status.num_blocks else 0.0,
        "prefix_hit_rate": round(status.prefix_hits / max(1, status.prefix_queries), 4),
    }


def _json(body: dict[str, Any]) -> str:
    return msgspec.json.encode(body).decode()  # a few times faster than json.dumps, per chunk


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes, by its length or as it arrives."""
    too_large = GatewayError(413, f"the request body is larger than {limit} bytes")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnected(request: Request) -> None:
    """Return when the HTTP client disconnects (the body is read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, or ClientGone once the client disconnects (and `work` is cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class Choices:
    """The events of one HTTP request's choices (one pipeline request each), merged in arrival
    order. `close` aborts what is unfinished (each `RequestClient.stream` does on leaving)."""

    def __init__(self, client: RequestClient, request_ids: list[str], span: Any, n: int = 1) -> None:
        self.client, self.request_ids = client, request_ids
        self.span = span  # the HTTP request's, ended with it
        self.started: set[int] = set()  # requests whose stream began (it aborts itself on leaving)
        self.queue: asyncio.Queue[tuple[int, TokenEvent | Exception]] = asyncio.Queue()
        self.held: tuple[int, TokenEvent | Exception] | None = None  # taken early by `ready_event`
        self.open = len(request_ids) * n  # choices without their last event
        # Request i's sample s is choice i * n + s.
        self.tasks = [
            asyncio.ensure_future(self._pump(i, i * n, client.stream(request_id)))
            for i, request_id in enumerate(request_ids)
        ]

    async def _pump(self, index: int, first_choice: int, stream: AsyncIterator[TokenEvent]) -> None:
        self.started.add(index)
        try:
            async for event in stream:
                self.queue.put_nowait((first_choice + event.sample_index, event))
        except Exception as error:  # PipelineGoneError, TimeoutError: the request's answer
            self.queue.put_nowait((first_choice, error))

    async def next(self) -> tuple[int, TokenEvent | Exception]:
        if self.held is not None:
            (index, item), self.held = self.held, None
        else:
            index, item = await self.queue.get()
        self._count(item)
        return index, item

    def ready_event(self, index: int, event: TokenEvent) -> TokenEvent | None:
        """Choice `index`'s event after `event` if it came already and `joins` it; None otherwise
        (what came, if anything, is kept for `next`)."""
        if self.held is None:
            try:
                self.held = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                return None
        held_index, item = self.held
        if held_index != index or isinstance(item, Exception) or not joins(event, item):
            return None
        self.held = None
        self._count(item)
        return item

    def _count(self, item: TokenEvent | Exception) -> None:
        if isinstance(item, Exception) or item.finish_reason is not None:
            self.open -= 1

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for index, request_id in enumerate(self.request_ids):
            if index not in self.started:  # cancelled before its stream began: abort it here
                await self.client.abandon(request_id)


def _failure(item: TokenEvent | Exception) -> GatewayError | None:
    """The answer to a choice's item that ends it with an error; None for a good event."""
    if isinstance(item, PipelineGoneError):
        return GatewayError(503, str(item))
    if isinstance(item, TimeoutError):
        return GatewayError(504, str(item) or "the request timed out")
    if isinstance(item, Exception):
        return GatewayError(500, f"{type(item).__name__}: {item}")
    if item.finish_reason is FinishReason.ERROR or item.error is not None:
        return pipeline_error(item)
    return None


class Gateway:
    def __init__(
        self,
        handler: GatewayHandler,
        client: RequestClient,
        health: Health,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.handler = handler
        self.client = client
        self.health = health
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics or GatewayMetrics()
        # Requests are checked and tokenized on a thread of their own: the tokenizers library
        # lets go of the GIL while it encodes (most of an open: 0.23 of 0.29 ms for 256 tokens),
        # and a burst of opens on the event loop held up the token events of the streams already
        # open (64 at once stalled it for 107-118 ms). One thread: opens keep their order, and
        # the tokenizer encodes on one thread only (the loop only decodes, for logprobs' texts:
        # an encode may reset its truncation, which a concurrent encode would find borrowed).
        self._opener = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parkade-open")

    def close(self) -> None:
        self._opener.shutdown(wait=False, cancel_futures=True)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                self._route("/v1/completions", self.completions, "POST"),
                self._route("/v1/chat/completions", self.chat_completions, "POST"),
                self._route("/v1/models", self.models, "GET"),
                self._route("/health", self.health_check, "GET"),
                self._route("/metrics", self.metrics_text, "GET"),
            ]
        )

    def _route(self, path: str, endpoint: Callable[[Request], Awaitable[Response]], method: str) -> Route:
        """`endpoint` behind the API key (on /v1/*), counted by its status."""
        guarded = path.startswith("/v1")

        async def answer(request: Request) -> Response:
            if guarded and not self._authorized(request):
                response: Response = error_response(
                    GatewayError(401, "invalid or missing API key", code="invalid_api_key")
                )
            else:
                response = await endpoint(request)
            self.metrics.requests.labels(path, str(response.status_code)).inc()
            return response

        return Route(path, answer, methods=[method])

    def _authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    async def models(self, request: Request) -> Response:
        return JSONResponse(self.handler.models())

    async def health_check(self, request: Request) -> Response:
        ok, detail = await self.health.report()
        return JSONResponse(detail, status_code=200 if ok else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, chat=True)

    async def generate(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        try:
            body = await read_body(request, self.max_body_bytes)
            # On the opener's thread (see __init__); in arrival order.
            opened = await asyncio.get_running_loop().run_in_executor(
                self._opener, self.handler.open, chat, body
            )
        except GatewayError as error:
            return error_response(error)
        except ClientDisconnect:
            return Response(status_code=499)  # gone before it finished sending
        self.metrics.prompt_tokens.inc(sum(c.num_prompt_tokens for c in opened.choices))
        # The request's trace starts here; its choices' records carry it through the pipeline.
        span = tracing.start_span(
            f"POST {request.url.path}",
            kind=tracing.trace.SpanKind.SERVER,
            attributes={"parkade.request_id": opened.answer.id, "parkade.num_choices": len(opened.choices)},
        )
        traceparent = tracing.traceparent_of(span) if span.is_recording() else None
        request_ids: list[str] = []
        try:
            for submit in opened.submits:
                request_ids.append(
                    await self.client.submit(**submit, traceparent=traceparent and traceparent.encode())
                )
        except (RecordRejected, PipelineGoneError, ValueError) as error:
            span.end()
            for request_id in request_ids:  # the choices sent already: nobody will read them
                await self.client.abandon(request_id)
            if isinstance(error, RecordRejected):
                return error_response(GatewayError(413, f"the request is too large for the broker: {error}"))
            return error_response(GatewayError(503, str(error)))
        choices = Choices(self.client, request_ids, span, opened.request.params.n)
        self.metrics.running.inc()
        handed_over = False
        try:
            # Until every choice has its first event: a refusal still gets its status.
            first = await unless_disconnected(request, self._first_events(opened, choices, arrival))
            if opened.request.stream:
                handed_over = True
                # send_timeout: a client that stops reading for that long is gone (its request
                # is aborted) rather than holding its KV blocks until max_tokens.
                stream = self._sse(opened, choices, first, arrival)
                return EventStream(stream, ping_s=PING_S, send_timeout_s=SEND_TIMEOUT_S)
            for index, event in first:
                opened.choices[index].add(event)  # first events are never errors here
            await unless_disconnected(request, self._rest(opened, choices, arrival))
            answer, token_text = opened.answer, self.handler.token_text
            body = answer.chat_response if chat else answer.completion_response
            return JSONResponse(body(opened.choices, token_text))
        except GatewayError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; the requests are aborted below
        finally:
            if not handed_over:
                await self._finish(choices)

    async def _finish(self, choices: Choices) -> None:
        # Shielded: a cancelled HTTP task must still abort its requests (bounded by the client).
        with anyio.CancelScope(shield=True):
            await choices.close()
        choices.span.end()
        self.metrics.running.dec()

    async def _next(self, opened: Opened, choices: Choices, arrival: float) -> tuple[int, TokenEvent]:
        """The next event of any choice, observed; GatewayError if it ends its choice in failure."""
        index, item = await choices.next()
        failure = _failure(item)
        if failure is not None:
            raise failure
        assert isinstance(item, TokenEvent)
        self._observe(opened, index, item, arrival)
        return index, item

    async def _first_events(
        self, opened: Opened, choices: Choices, arrival: float
    ) -> list[tuple[int, TokenEvent]]:
        """Each choice's events until its first one; GatewayError if one fails first."""
        buffered: list[tuple[int, TokenEvent]] = []
        while len({index for index, _ in buffered}) < len(opened.choices):
            buffered.append(await self._next(opened, choices, arrival))
        return buffered

    async def _rest(self, opened: Opened, choices: Choices, arrival: float) -> None:
        while choices.open:
            index, event = await self._next(opened, choices, arrival)
            opened.choices[index].add(event)

    async def _sse(
        self, opened: Opened, choices: Choices, first: list[tuple[int, TokenEvent]], arrival: float
    ) -> AsyncIterator[str]:
        """The stream's `data:` payloads: chunks, the usage chunk if asked, `[DONE]`."""
        request, answer, token_text = opened.request, opened.answer, self.handler.token_text
        shown: set[int] = set()  # choices whose first chunk (with the role, for chat) went out

        def chunk(index: int, event: TokenEvent) -> str | None:
            choice = opened.choices[index]
            # Offsets of logprob tokens follow the tokens' texts, not what was shown (text held
            # back for a possible stop string would shift them).
            offset = choice.logprob_text_offset
            choice.logprob_text_offset += sum(len(token_text(p.token_ids[0])) for p in event.logprobs or ())
            choice.add(event)
            if not event.text and not event.logprobs and event.finish_reason is None and index in shown:
                return None  # text held back (a possible stop string): nothing to show yet
            body = answer.chunk(request.chat, choice, event, token_text, offset, index not in shown)
            shown.add(index)
            if request.continuous_usage:
                # This choice's usage: its prompt is counted on its prompt's first sample only.
                prompt = opened.choices[index - index % request.params.n]
                alone = dataclasses.replace(choice, num_prompt_tokens=prompt.num_prompt_tokens)
                body["usage"] = answer.usage_chunk(request.chat, [alone])["usage"]
            return _json(body)

        try:
            for index, event in first:
                if (data := chunk(index, event)) is not None:
                    yield data
            try:
                while choices.open:
                    index, event = await self._next(opened, choices, arrival)
                    event = self._with_ready(opened, choices, index, event, arrival)
                    if (data := chunk(index, event)) is not None:
                        yield data
                if request.include_usage:
                    yield _json(answer.usage_chunk(request.chat, opened.choices))
            except GatewayError as failure:  # after the first token: the stream says it
                yield _json(answer.error_chunk(failure))
            yield "[DONE]"
        finally:
            await self._finish(choices)

    def _with_ready(
        self, opened: Opened, choices: Choices, index: int, event: TokenEvent, arrival: float
    ) -> TokenEvent:
        """`event` joined with its choice's events that came already: one chunk for them, as vLLM's
        server sends one for the outputs it is behind on. Under load a stream lags a step or two
        (a poll of the tokenizer or of this client brings several steps), and each chunk costs
        this process and the client a send, a frame and a parse."""
        while (then := choices.ready_event(index, event)) is not None:
            self._observe(opened, index, then, arrival)
            event = joined(event, then)
        return event

    def _observe(self, opened: Opened, index: int, event: TokenEvent, arrival: float) -> None:
        """Latency metrics, as this gateway's client sees them."""
        now = time.monotonic()
        choice = opened.choices[index]
        if event.token_ids:
            if choice.last_event_at is None:
                self.metrics.ttft.observe(now - arrival)
            else:
                gap = (now - choice.last_event_at) / len(event.token_ids)
                for _ in event.token_ids:
                    self.metrics.itl.observe(gap)
            choice.last_event_at = now
            self.metrics.generation_tokens.inc(len(event.token_ids))
        if event.finish_reason is not None and event.finish_reason is not FinishReason.ERROR:
            self.metrics.e2e.observe(now - arrival)


# ---- the process -----------------------------------------------------------------------------
class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the service's own handlers stop it (`run_until_signalled`)
        yield


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _server(app: Starlette) -> _Server:
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=GRACEFUL_STOP_S,
    )
    return _Server(config)


async def serve(
    bootstrap_servers: str,
    prefix: str,
    handler: GatewayHandler,
    options: GatewayOptions,
    *,
    api_key: str | None,
    stop: asyncio.Event,
    broker_wait_s: float,
    idempotence: bool = False,
    ready: Callable[[str], None] | None = None,
    metrics: GatewayMetrics | None = None,
    beside: tuple[str, Service] | None = None,
) -> None:
    """Serve HTTP until `stop`; `ready(url)` once it listens (`parkade up` reads the line).
    `beside`: (instance name, service) run in this process, that reads this gateway's requests
    and writes their events, both in memory (`parkade gateway --with-tokenizer`)."""
    from parkade.services.bus.kafka import KafkaBus, wait_for_broker

    sock = listening_socket(options.host, options.http_port)  # first: a taken port fails at once
    await wait_for_broker(bootstrap_servers, timeout_s=broker_wait_s)
    kafka = KafkaBus(
        bootstrap_servers, client_id="parkade-gateway", idempotence=idempotence, producer_thread=True
    )
    bus, client = _client(kafka, prefix, bootstrap_servers, beside)
    alongside = (
        _Beside(beside, bus, bootstrap_servers, prefix, broker_wait_s, idempotence) if beside else None
    )
    try:
        await bus.create_topics(topics.all_topic_names(prefix))
        await client.start()
        if alongside is not None:
            await alongside.start()
        health = Health(client)
        follow = asyncio.create_task(health.follow())
        gateway = Gateway(
            handler, client, health, api_key=api_key, max_body_bytes=options.max_body_bytes, metrics=metrics
        )
        gateway.metrics.register(_ReplicaGauges(health))
        server = _server(gateway.app())
        if ready is None:  # its own process: see heap.py
            freeze_startup_heap()
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if server.started:
            _announce(sock, ready)
            await _until_stopped(serving, stop, alongside)
        server.should_exit = True
        await serving
        follow.cancel()
        gateway.close()
    finally:
        await client.stop()
        sock.close()
        # NOTE: last: the streams let finish, and the aborts of those cut, needed it.
        if alongside is not None:
            await alongside.stop()


def _client(
    kafka: Bus, prefix: str, bootstrap_servers: str, beside: tuple[str, Service] | None
) -> tuple[Bus, RequestClient]:
    """The gateway's bus and client. Beside a tokenizer, its requests (a requests topic of its
    own, which the tokenizer reads too) and their events (its reply topic) stay in memory."""
    reply_topic = replies.new_reply_topic(prefix)
    if beside is None:
        return kafka, RequestClient(
            kafka, prefix, bootstrap_servers=bootstrap_servers, reply_topic=reply_topic
        )
    requests_topic = topics.gateway_requests(reply_topic.rsplit(".", 1)[1])
    bus = SplitBus(kafka, [reply_topic, topics.topic_name(requests_topic, prefix)])
    client = RequestClient(
        bus,
        prefix,
        bootstrap_servers=bootstrap_servers,
        reply_topic=reply_topic,
        requests_topic=requests_topic,
    )
    beside[1].consumes = (*beside[1].consumes, requests_topic)
    return bus, client


async def _until_stopped(serving: asyncio.Task[None], stop: asyncio.Event, alongside: _Beside | None) -> None:
    """Until `stop`, or the HTTP server ends, or the service beside does (its error then)."""
    stopped = asyncio.ensure_future(stop.wait())
    also = {alongside.task} if alongside is not None and alongside.task is not None else set()
    await asyncio.wait({serving, stopped, *also}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()


def _announce(sock: socket.socket, ready: Callable[[str], None] | None) -> None:
    host, port = sock.getsockname()[:2]
    shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)
    url = f"http://{shown}:{port}/v1"
    log.info("ready: %s", url)
    if ready is not None:
        ready(url)
    else:  # the protocol line `parkade up` waits for (stdout; the logs go to stderr)
        sys.stdout.write(f"READY gateway {url}\n")
        sys.stdout.flush()


class _Beside:
    """The service that runs beside the gateway (see `serve`), as it runs alone (`parkade
    tokenizer`: its own bus, consumer group and instance claim), but reading the gateway's
    requests topic and writing to its reply topic in the gateway's memory."""

    def __init__(
        self,
        beside: tuple[str, Service],
        gateway_bus: Bus,
        bootstrap_servers: str,
        prefix: str,
        wait_s: float,
        idempotence: bool,
    ) -> None:
        self.name, self.service = beside
        assert isinstance(gateway_bus, SplitBus), "the gateway's bus keeps its own topics in memory"
        self.gateway_bus = gateway_bus
        self.bootstrap_servers, self.prefix = bootstrap_servers, prefix
        self.wait_s, self.idempotence = wait_s, idempotence
        self.stopping = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Until it consumes; its error if it fails first (another instance serves, ...)."""
        ready = asyncio.Event()
        self.task = asyncio.create_task(self._serve(ready))
        started = asyncio.ensure_future(ready.wait())
        await asyncio.wait({self.task, started}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if self.task.done():
            self.task.result()
            raise RuntimeError(f"the {self.name} stopped before it served")

    async def stop(self) -> None:
        """Let it finish its batch and stop; its error, if it failed, is raised (the process's)."""
        self.stopping.set()
        if self.task is not None:
            await self.task

    async def _serve(self, ready: asyncio.Event) -> None:
        from parkade.services.bus.runtime import on_kafka
        from parkade.services.bus.serve import serve

        service, prefix = self.service, self.prefix
        await on_kafka(
            self.bootstrap_servers,
            prefix,
            self.name,
            lambda bus: serve(bus, service, prefix=prefix, stop=self.stopping, ready=ready.set),
            wait_s=self.wait_s,
            idempotence=self.idempotence,
            instances=[service.instance_name or self.name],
            own_topics=tuple(service.own_topics()),
            local_topics=tuple(self.gateway_bus.local_topics),
            local=self.gateway_bus.local,
        )


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The gateway's event loop: uvloop's where it is installed (a dependency on Linux and macOS),
    as uvicorn's standard install and vLLM's server run; else asyncio's.

    Why: a client's burst opens its connections at once, and each costs the loop an accept, a
    transport and a parse before any request's handler runs; in pure-Python asyncio that held a
    burst's first handler back 30-44 ms (vLLM's client, 64 new connections; the last handler
    started 51-55 ms after the sends). Measured under `parkade up` (tiny-llama, 64 prompts of
    256 tokens, 128 out, four stacks each, alternated, 2026-12-06): the first TTFT 50-112 ms (six
    of eight rounds under 71) against 98-152, output 3,735-5,266 tok/s (mean 4,466) against
    3,653-4,218 (3,952), TPOT 12.4 against 14.1 ms, the gateway's CPU 0.66-0.86 s a round against
    0.87-0.95. Only the gateway: the other services' loops mostly wait on the broker, and uvloop
    changed nothing measurable there (the replica's, alternated the same way: output 4,224 against
    4,268 tok/s, mean TTFT within the noise)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _metrics(args: argparse.Namespace, beside: Service | None) -> GatewayMetrics | None:
    """The gateway's metrics, and the service beside's with them: at /metrics, and at
    --metrics-port when given, as every service's; None after saying why that port cannot serve."""
    from parkade.services.bus.runtime import merged, serve_metrics

    metrics = GatewayMetrics()
    if beside is not None:
        metrics.registry = merged([metrics.registry, beside.enable_metrics().registry])
    if args.metrics_port is not None and not serve_metrics("gateway", args, metrics.registry):
        return None
    return metrics


def parser() -> argparse.ArgumentParser:
    """The command line: the bus options, the gateway's flags and --api-key."""
    parser = service_parser("gateway", __doc__)
    add_flags(parser, FLAGS)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PARKADE_API_KEY"),
        help="bearer token that /v1/* requires (default: $PARKADE_API_KEY; unset: none)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    command = parser()
    return run(command, command.parse_args(argv))


def run(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    beside: Callable[[GatewayOptions], tuple[str, Service]] | None = None,
) -> int:
    """Serve until a signal; -> the exit code. `beside(options)`: the service to run in this
    process (see `serve`), built once the settings are checked (ValueError: it cannot work)."""
    if not args.bootstrap_servers:
        parser.error("no broker: pass --bootstrap-servers or set KAFKA_BOOTSTRAP_SERVERS")
    options = GatewayOptions(**flag_values(FLAGS, args))
    if not connection_settings_ok("gateway"):
        return 2
    logs.configure("gateway")
    tracing.configure("gateway", os.environ)
    try:
        handler = GatewayHandler.from_options(options)
        service = beside(options) if beside is not None else None
    except ValueError as error:
        print(f"parkade gateway: {error}", file=sys.stderr)
        return 2

    from parkade.services.bus.runtime import until_signalled

    metrics = _metrics(args, service[1] if service is not None else None)
    if metrics is None:
        return 1

    async def serve_until(stop: asyncio.Event) -> None:
        await serve(
            args.bootstrap_servers,
            args.topic_prefix,
            handler,
            options,
            api_key=args.api_key or None,
            stop=stop,
            broker_wait_s=args.broker_wait,
            idempotence=args.idempotence,
            metrics=metrics,
            beside=service,
        )

    try:
        # (a broker it cannot reach, topics laid out wrong, another instance of the service
        # beside: one line each, as every service says them)
        return until_signalled("gateway", args, serve_until, event_loop_factory())
    except OSError as error:  # the address is taken, or not ours
        print(
            f"parkade gateway: cannot listen on {options.host}:{options.http_port}: {error}", file=sys.stderr
        )
        return 1
    finally:
        tracing.shutdown()  # what is buffered goes out
