"""`EventStream` (the gateway's server-sent events) on a fake ASGI connection: the framing, the
end of the response, and each way a stream ends early (a client that disconnects, a client that
stops reading, a payload source that fails), with the payload source's cleanup run every time."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from parkade.services.gateway.sse import EventStream


class Connection:
    """The ASGI side of one HTTP connection: what the app sent, a client that may disconnect
    (`gone`) and may stop reading (`stalled`: a body send then blocks, as a full socket buffer
    makes uvicorn's `send` wait)."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.gone = asyncio.Event()
        self.stalled = False

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.stalled and message["type"] == "http.response.body":
            await asyncio.Event().wait()  # never
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.messages if m["type"] == "http.response.body")


class Source:
    """An async generator of payloads that records whether its cleanup ran."""

    def __init__(self, payloads: list[str], then_wait: bool = False, fail: bool = False) -> None:
        self.payloads, self.then_wait, self.fail = payloads, then_wait, fail
        self.cleaned = False

    async def __call__(self):
        try:
            for payload in self.payloads:
                yield payload
            if self.fail:
                raise RuntimeError("the pipeline went away")
            if self.then_wait:
                await asyncio.Event().wait()
        finally:
            with anyio.CancelScope(shield=True):  # an await in the cleanup, shielded as the gateway's
                await asyncio.sleep(0)
            self.cleaned = True


def serve(stream: EventStream, connection: Connection, timeout_s: float = 5.0):
    return asyncio.wait_for(stream({"type": "http"}, connection.receive, connection.send), timeout_s)


def test_events_are_framed_as_data_lines_and_the_response_ends():
    connection, source = Connection(), Source(['{"a": 1}', "[DONE]"])

    asyncio.run(serve(EventStream(source(), ping_s=15, send_timeout_s=30), connection))

    start = connection.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-store"
    assert b"content-length" not in headers  # a stream's length is not known up front
    assert connection.body == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert connection.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert source.cleaned


def test_a_disconnect_ends_a_waiting_stream_and_runs_its_cleanup():
    async def main():
        connection, source = Connection(), Source(["first"], then_wait=True)
        task = asyncio.ensure_future(serve(EventStream(source(), ping_s=15, send_timeout_s=30), connection))
        while b"first" not in connection.body:
            await asyncio.sleep(0.01)
        connection.gone.set()
        await task
        return connection, source

    connection, source = asyncio.run(main())
    assert source.cleaned
    assert connection.messages[-1].get("more_body", False)  # not finished: nobody reads it


def test_a_client_that_stops_reading_is_cut_off_after_the_send_timeout():
    connection, source = Connection(), Source(["never sent"], then_wait=True)
    connection.stalled = True
    stream = EventStream(source(), ping_s=15, send_timeout_s=0.2, tick_s=0.05)

    asyncio.run(serve(stream, connection, timeout_s=3))

    assert source.cleaned
    assert connection.body == b""


def test_a_quiet_client_that_stops_reading_is_cut_off_at_a_ping():
    """No event to send, and the keep-alive ping itself blocks: the stream still ends."""

    async def main():
        connection, source = Connection(), Source(["x"], then_wait=True)
        stream = EventStream(source(), ping_s=0.1, send_timeout_s=0.3, tick_s=0.02)
        task = asyncio.ensure_future(serve(stream, connection, timeout_s=3))
        while b"data: x" not in connection.body:
            await asyncio.sleep(0.01)
        connection.stalled = True  # from now on every body send blocks
        await task
        return connection, source

    connection, source = asyncio.run(main())
    assert source.cleaned
    assert connection.body == b"data: x\n\n"


def test_a_quiet_stream_sends_keep_alive_comments():
    async def main():
        connection, source = Connection(), Source(["x"], then_wait=True)
        task = asyncio.ensure_future(
            serve(EventStream(source(), ping_s=0.1, send_timeout_s=30, tick_s=0.02), connection)
        )
        await asyncio.sleep(0.5)
        connection.gone.set()
        await task
        return connection

    body = asyncio.run(main()).body
    assert body.startswith(b"data: x\n\n")
    pings = body.count(b": ping\n\n")
    assert 2 <= pings <= 6, body  # one about every 0.1 s of the 0.5 s, none between events


def test_a_failing_source_raises_and_the_response_stays_unfinished():
    connection, source = Connection(), Source(["a"], fail=True)

    with pytest.raises(Exception, match="the pipeline went away"):
        asyncio.run(serve(EventStream(source(), ping_s=15, send_timeout_s=30), connection))
    assert source.cleaned
    assert connection.body == b"data: a\n\n"
