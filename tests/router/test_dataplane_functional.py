"""The raw data plane (router/gateway/dataplane.py) over real sockets: the HTTP/1.1 behaviour of its
own server and the handover of other requests to aiohttp on the same connection. Every test runs on
the standard event loop and on uvloop (what ``kvroute serve`` runs on: its transports differ).

The gateway behaviour both servers share (routing, retries, streams, errors, disconnects) is
tests/router/test_gateway_functional.py, which runs once per ``downstream.server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

import httptools
import pytest
from aiohttp import web

from tests.router.conftest import wait_for

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    if request.param == "uvloop":
        import uvloop

        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


def _body(stream: bool = False, n: int = 0) -> bytes:
    msg = {"model": "m", "messages": [{"role": "user", "content": "hi" + "x" * n}], "max_tokens": 4}
    if stream:
        msg["stream"] = True
    return json.dumps(msg).encode()


def _request(
    method: str, path: str, headers: Sequence[tuple[str, str]] = (), body: bytes = b"", version: str = "1.1"
) -> bytes:
    head = [f"{method} {path} HTTP/{version}", "Host: gw"]
    head += [f"{k}: {v}" for k, v in headers]
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.done = True


class Conn:
    """A raw HTTP/1.1 client connection that reads responses one by one (httptools parses them)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._buf = b""

    @classmethod
    async def open(cls, port: int) -> Conn:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        return cls(r, w)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def response(self, timeout_s: float = 5.0, close_delimited: bool = False) -> _Response:
        resp = _Response()
        parser = httptools.HttpResponseParser(resp)
        data, self._buf = self._buf, b""
        async with asyncio.timeout(timeout_s):
            while True:
                if data:
                    try:
                        parser.feed_data(data)
                    except httptools.HttpParserUpgrade:
                        pass
                    if resp.done:
                        resp.status = parser.get_status_code()
                        return resp
                data = await self.reader.read(65536)
                if not data:
                    if close_delimited:
                        parser.feed_data(b"")  # no-op: the body ended with the connection
                        resp.status = parser.get_status_code()
                        return resp
                    raise ConnectionError(f"closed before a whole response (got {resp.body[:200]!r})")

    async def interim(self) -> bytes:
        """The raw bytes of one 1xx answer."""
        async with asyncio.timeout(5):
            while b"\r\n\r\n" not in self._buf:
                chunk = await self.reader.read(65536)
                assert chunk, "closed"
                self._buf += chunk
        head, _, self._buf = self._buf.partition(b"\r\n\r\n")
        return head

    async def closed(self, timeout_s: float = 5.0) -> bool:
        """The gateway closed the connection (an end of stream, or a reset: it had unread bytes)."""
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    chunk = await self.reader.read(65536)
                except ConnectionResetError:
                    return True
                if not chunk:
                    return True

    def close(self) -> None:
        self.writer.close()


def _chat(session: str, rid: str, stream: bool = False, version: str = "1.1", extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    hs = [("Content-Type", "application/json"), ("Modal-Session-Id", session), ("X-Request-Id", rid), *extra]
    return _request("POST", CHAT, hs, _body(stream), version)


async def test_other_routes_are_handed_to_aiohttp_on_the_same_connection(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    plane = gw.runtime.data_plane
    assert plane is not None
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "a"))
    first = await c.response()
    assert first.status == 200 and first.headers["x-kvroute-replica"] == rep.id
    assert first.headers["x-request-id"] == "a" and json.loads(first.body)["choices"]
    assert len(plane.conns) == 1  # still the data plane's
    await c.send(_request("GET", "/health", [("X-Request-Id", "b")]))
    health = await c.response()
    assert health.status == 200 and json.loads(health.body)["gateway_id"] == "test-gw"
    assert health.headers["x-request-id"] == "b"
    await wait_for(lambda: not plane.conns)  # aiohttp's now: the transport talks to its handler
    await c.send(_chat("s1", "c"))
    third = await c.response()
    assert third.status == 200 and third.headers["x-request-id"] == "c"
    assert third.headers["x-kvroute-reason"] == "affinity"  # routed by the same runtime
    await c.send(_request("GET", "/nope"))
    assert (await c.response()).status == 404
    assert len(rep.state.requests) == 2
    c.close()


async def test_pipelined_requests_are_answered_in_order(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    rep.state.first_delay_s = 0.05  # the first answer is still coming when the others arrive
    gw = await gateway_factory([rep.url])
    c = await Conn.open(gw.port)
    await c.send(
        _chat("s1", "r1", stream=True)
        + _chat("s2", "r2")
        + _request("GET", "/health", [("X-Request-Id", "r3")])
        + _chat("s1", "r4")
    )
    got = [await c.response() for _ in range(4)]
    assert [r.headers["x-request-id"] for r in got] == ["r1", "r2", "r3", "r4"]
    assert [r.status for r in got] == [200, 200, 200, 200]
    assert b"data: [DONE]" in got[0].body and got[0].headers["transfer-encoding"] == "chunked"
    assert json.loads(got[2].body)["status"] == "ok"
    assert len(rep.state.requests) == 3
    c.close()


async def test_chunked_body_and_expect_continue(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    body = _body(n=3000)
    c = await Conn.open(gw.port)
    pieces = [body[:1000], body[1000:2500], body[2500:]]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    hs = [("Content-Type", "application/json"), ("Modal-Session-Id", "s1"), ("Transfer-Encoding", "chunked")]
    await c.send(_request("POST", CHAT, hs) + chunked)
    assert (await c.response()).status == 200
    assert rep.state.requests[-1]["body"] == body  # reassembled byte for byte
    # Expect: 100-continue: the interim answer comes before the client sends the body
    await c.send(_request("POST", CHAT, [("Modal-Session-Id", "s1"), ("Expect", "100-continue"),
                                        ("Content-Length", str(len(body)))]))  # fmt: skip
    assert (await c.interim()).startswith(b"HTTP/1.1 100 Continue")
    await c.send(body)
    assert (await c.response()).status == 200
    assert "expect" not in {k.lower() for k in rep.state.requests[-1]["headers"]}
    c.close()


async def test_http10_and_connection_close(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    # HTTP/1.0 without keep-alive: answered in HTTP/1.0, then closed; a stream ends with the connection
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "a", stream=True, version="1.0"))
    r = await c.response(close_delimited=True)
    assert r.status == 200 and r.headers["connection"] == "close"
    assert "transfer-encoding" not in r.headers and r.body.rstrip().endswith(b"data: [DONE]")
    # HTTP/1.0 keep-alive: the connection stays
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "b", version="1.0", extra=(("Connection", "keep-alive"),)))
    r = await c.response()
    assert r.status == 200 and r.headers["connection"] == "keep-alive"
    await c.send(_chat("s1", "c", version="1.0", extra=(("Connection", "keep-alive"),)))
    assert (await c.response()).status == 200
    c.close()
    # HTTP/1.1 with Connection: close
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "d", extra=(("Connection", "close"),)))
    r = await c.response()
    assert r.status == 200 and r.headers["connection"] == "close"
    assert await c.closed()


async def test_idle_connections_are_closed(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], downstream={"keepalive_s": 0.2})
    used = await Conn.open(gw.port)
    await used.send(_chat("s1", "a"))
    assert (await used.response()).status == 200
    silent = await Conn.open(gw.port)  # never sends a byte
    assert await used.closed(3.0) and await silent.closed(3.0)
    # a connection with a request in progress is not idle, however long the answer takes
    rep.state.first_delay_s = 0.6
    slow = await Conn.open(gw.port)
    await slow.send(_chat("s1", "b"))
    assert (await slow.response(3.0)).status == 200


async def test_a_trickled_head_does_not_hold_a_connection(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], downstream={"keepalive_s": 0.3})
    c = await Conn.open(gw.port)
    loop = asyncio.get_running_loop()
    start = loop.time()
    head = _chat("s1", "slow").split(b"\r\n\r\n")[0]
    with contextlib.suppress(ConnectionError):
        for i in range(len(head)):  # a byte every 50 ms: never 0.3 s without one
            await c.send(head[i : i + 1])
            await asyncio.sleep(0.05)
            if c.reader.at_eof():
                break
    assert await c.closed(2.0)
    assert loop.time() - start < 2.0  # well before the head would have been whole (~10 s)
    assert rep.state.requests == []


async def test_limits_are_refused_before_the_body_is_read(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], limits={"max_body_bytes": 4096, "max_field_size": 2048,
                                                  "max_headers": 16})  # fmt: skip
    # a declared length over the limit: 413 at once, though no byte of the body was sent
    c = await Conn.open(gw.port)
    await c.send(_request("POST", CHAT, [("Modal-Session-Id", "s1"), ("Content-Length", "100000"),
                                        ("X-Request-Id", "big")]))  # fmt: skip
    r = await c.response()
    assert r.status == 413 and json.loads(r.body)["error"]["code"] == "payload_too_large"
    assert r.headers["x-request-id"] == "big" and r.headers["connection"] == "close"
    assert await c.closed()
    # a head that never ends (no line end, so no header is ever whole): refused once it outgrows
    # the limits, while the client is still sending, instead of being buffered without end
    c = await Conn.open(gw.port)
    answer = asyncio.create_task(c.response(10.0))
    await c.send(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nX-Long: ")
    with contextlib.suppress(ConnectionError):
        for _ in range(2000):
            if answer.done():
                break
            await c.send(b"a" * 16384)
    refused = await answer
    err = json.loads(refused.body)["error"]
    assert refused.status == 400 and err["code"] == "bad_http_request"
    assert err["message"] == "request head too large"
    # too many headers
    c = await Conn.open(gw.port)
    await c.send(_request("POST", CHAT, [(f"X-H{i}", "v") for i in range(20)], _body()))
    r = await c.response()
    assert r.status == 400 and "headers" in json.loads(r.body)["error"]["message"]
    assert rep.state.requests == []  # nothing refused reached the replica


async def test_upgrade_requests_go_to_aiohttp(fake_replicas: Any, gateway_factory: Any) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    c = await Conn.open(gw.port)
    await c.send(_request("GET", "/health", [("Connection", "Upgrade"), ("Upgrade", "websocket")]))
    r = await c.response()
    assert r.status == 200 and json.loads(r.body)["status"] == "ok"
    c.close()


async def test_shutdown_finishes_requests_in_flight_and_closes_idle_connections(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url])
    idle = await Conn.open(gw.port)
    await idle.send(_chat("s1", "warm"))
    assert (await idle.response()).status == 200
    rep.state.first_delay_s = 0.4
    busy = await Conn.open(gw.port)
    await busy.send(_chat("s2", "late"))
    await wait_for(lambda: rep.state.active == 1)
    closing = asyncio.create_task(gw.close())
    assert await idle.closed(2.0)  # idle keep-alive connections go at once
    r = await busy.response(3.0)
    assert r.status == 200 and r.headers["connection"] == "close" and json.loads(r.body)["choices"]
    await closing
    assert gw.runtime.in_flight == 0


async def test_shutdown_cancels_what_outlives_it_and_releases_its_load(
    fake_replicas: Any, gateway_factory: Any
) -> None:
    (rep,) = await fake_replicas(1)
    gw = await gateway_factory([rep.url], timeouts={"shutdown_s": 0.3})
    rep.state.first_delay_s = 10.0
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "stuck"))
    await wait_for(lambda: rep.state.active == 1)
    store = gw.store
    assert sum(r.in_flight for r in await store.replicas()) == 1
    await gw.close()  # 0.3 s for in-flight requests, then they are cancelled
    assert await c.closed(2.0)  # no answer could be given: the connection closes
    assert gw.runtime.in_flight == 0
    assert sum(r.in_flight for r in await store.replicas()) == 0  # no phantom load
    await wait_for(lambda: rep.state.aborted == 1)  # the engine saw the request go


@pytest.fixture
async def big_replica() -> Any:
    """A replica that streams 8 MiB of SSE in 64 KiB events (the client's back-pressure matters)."""
    chunk = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(128):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post(CHAT, stream)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", 128 * len(chunk) + len(b"data: [DONE]\n\n")
    await runner.cleanup()


async def test_a_slow_reader_gets_the_whole_stream(big_replica: Any, gateway_factory: Any) -> None:
    url, size = big_replica
    gw = await gateway_factory([url])
    c = await Conn.open(gw.port)
    await c.send(_chat("s1", "big", stream=True))
    await asyncio.sleep(0.5)  # the gateway's socket buffer fills: it must wait, not buffer 8 MiB or drop
    r = await c.response(10.0)
    assert r.status == 200 and len(r.body) == size and r.body.endswith(b"data: [DONE]\n\n")
    c.close()
