"""``ReplicaHttpClient`` (router/gateway/upstream.py) against real servers on 127.0.0.1: a small
scripted aiohttp server with one route per wire behaviour, and the replica emulator.

Each test checks what reaches the wire or the socket (bytes, headers, connections opened and closed),
not the client's internals.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from replica.emulator.profiles import get_profile
from replica.emulator.runner import start_emulators, stop_emulators
from replica.emulator.server import EmulatorConfig
from router.config import TimeoutsConfig
from router.errors import UpstreamBrokenError, UpstreamConnectError, UpstreamTimeoutError
from router.gateway.forward import is_connect_failure
from router.gateway.upstream import ReplicaHttpClient

_PAYLOAD = bytes(range(256)) * 40  # not UTF-8: bytes must pass untouched


@dataclass
class Script:
    """What the scripted server saw, and knobs the tests turn."""

    peers: list[tuple[str, int]] = field(default_factory=list)  # client address of each request
    headers: list[list[tuple[str, str]]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)  # lets /sse send its second event
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)  # /slow saw the client go
    delay_s: float = 0.0


def _record(script: Script, request: web.Request, body: bytes) -> None:
    peer = request.transport.get_extra_info("peername") if request.transport else None
    script.peers.append(tuple(peer[:2]) if peer else ("", 0))
    script.headers.append([(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers])
    script.bodies.append(body)


def _app(script: Script) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        _record(script, request, body)
        return web.Response(body=body, content_type="application/octet-stream")

    async def cl(request: web.Request) -> web.Response:
        _record(script, request, await request.read())
        return web.Response(body=_PAYLOAD, content_type="application/json")

    async def chunked(request: web.Request) -> web.StreamResponse:
        _record(script, request, await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(0, len(_PAYLOAD), 1000):
            await resp.write(_PAYLOAD[i : i + 1000])
        await resp.write_eof()
        return resp

    async def sse(request: web.Request) -> web.StreamResponse:
        _record(script, request, await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"n":1}\n\n')
        await script.release.wait()
        await resp.write(b'data: {"n":2}\n\ndata: [DONE]\n\n')
        await resp.write_eof()
        return resp

    async def close(request: web.Request) -> web.Response:
        _record(script, request, await request.read())
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def cut(request: web.Request) -> web.StreamResponse:
        _record(script, request, await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 100
        await resp.prepare(request)
        await resp.write(b"x" * 50)
        assert request.transport is not None
        request.transport.close()
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:
        _record(script, request, await request.read())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await asyncio.sleep(script.delay_s)  # cancelled here if the client leaves early
            await resp.prepare(request)
            for _ in range(200):
                await resp.write(b"data: tick\n\n")
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.CancelledError):
            script.disconnected.set()
            raise
        return resp

    async def probe(request: web.Request) -> web.Response:
        _record(script, request, await request.read())
        await asyncio.sleep(script.delay_s)
        if request.query.get("gz"):
            return web.Response(body=b"\x1f\x8b...", headers={"Content-Encoding": "gzip"})
        return web.Response(body=b"ok " + request.headers.get("Accept", "-").encode())

    app = web.Application()
    app.router.add_get("/probe", probe)
    for name, h in (("echo", echo), ("cl", cl), ("chunked", chunked), ("sse", sse), ("close", close)):
        app.router.add_post(f"/{name}", h)
    app.router.add_post("/cut", cut)
    app.router.add_post("/slow", slow)
    return app


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, Script]]:
    script = Script()
    runner = web.AppRunner(_app(script), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", script
    await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[ReplicaHttpClient]:
    c = ReplicaHttpClient(TimeoutsConfig(connect_s=1.0, first_byte_s=2.0, idle_read_s=2.0))
    yield c
    await c.close()


async def _body(resp: Any) -> bytes:
    out = b"".join([c async for c in resp.chunks()])
    resp.release()
    return out


async def test_keep_alive_connection_is_reused(server: tuple[str, Script], client: ReplicaHttpClient) -> None:
    url, script = server
    for i in range(3):
        resp = await client.send("r", "POST", url + "/echo", [("X-N", str(i))], b"body-%d" % i)
        assert resp.status == 200 and await _body(resp) == b"body-%d" % i
    assert client.connections_opened == 1
    assert len(set(script.peers)) == 1  # the server saw one client socket


async def test_only_host_and_content_length_are_added(
    server: tuple[str, Script], client: ReplicaHttpClient
) -> None:
    url, script = server
    resp = await client.send("r", "POST", url + "/echo", [("X-A", "1"), ("x-a", "2")], _PAYLOAD)
    assert await _body(resp) == _PAYLOAD
    assert script.bodies[-1] == _PAYLOAD
    names = [k.lower() for k, _ in script.headers[-1]]
    assert sorted(names) == ["content-length", "host", "x-a", "x-a"]
    assert {k.lower(): v for k, v in script.headers[-1]}["host"] == url.removeprefix("http://")


async def test_content_length_and_chunked_bodies(
    server: tuple[str, Script], client: ReplicaHttpClient
) -> None:
    url, _ = server
    resp = await client.send("r", "POST", url + "/cl", [], b"{}")
    assert resp.content_length == len(_PAYLOAD) and resp.content_type == "application/json"
    assert await _body(resp) == _PAYLOAD
    resp = await client.send("r", "POST", url + "/chunked", [], b"{}")
    assert resp.content_length is None
    assert ("Transfer-Encoding", "chunked") in list(resp.headers)  # filtered by the caller, not here
    assert await _body(resp) == _PAYLOAD  # chunk framing removed, payload untouched
    assert client.connections_opened == 1  # both ends were delimited: the connection was kept


async def test_sse_is_relayed_as_it_arrives(server: tuple[str, Script], client: ReplicaHttpClient) -> None:
    url, script = server
    resp = await client.send("r", "POST", url + "/sse", [], b"{}")
    chunks = resp.chunks().__aiter__()
    first = await asyncio.wait_for(anext(chunks), 2)  # the second event is not even written yet
    assert first == b'data: {"n":1}\n\n'
    script.release.set()
    rest = b"".join([c async for c in chunks])
    assert rest == b'data: {"n":2}\n\ndata: [DONE]\n\n'
    resp.release()


async def test_connection_close_is_not_reused(server: tuple[str, Script], client: ReplicaHttpClient) -> None:
    url, script = server
    for _ in range(2):
        resp = await client.send("r", "POST", url + "/close", [], b"")
        assert await _body(resp) == b"bye"
    assert client.connections_opened == 2 and len(set(script.peers)) == 2


async def test_break_mid_body_is_broken_and_not_reused(
    server: tuple[str, Script], client: ReplicaHttpClient
) -> None:
    url, _ = server
    resp = await client.send("r", "POST", url + "/cut", [], b"")
    assert resp.status == 200 and resp.content_length == 100
    got = b""
    with pytest.raises(UpstreamBrokenError):
        async for chunk in resp.chunks():
            got += chunk
    assert got == b"x" * 50
    resp.abort()
    resp = await client.send("r", "POST", url + "/echo", [], b"after")
    assert await _body(resp) == b"after"
    assert client.connections_opened == 2


async def test_connect_refused_is_a_connect_failure(client: ReplicaHttpClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(UpstreamConnectError) as info:
            await client.send("r", "POST", f"http://127.0.0.1:{port}/x", [], b"")
    assert is_connect_failure(info.value)


async def test_first_byte_and_idle_timeouts(server: tuple[str, Script]) -> None:
    url, script = server
    client = ReplicaHttpClient(TimeoutsConfig(connect_s=0.2, first_byte_s=0.3, idle_read_s=0.3))
    try:
        script.delay_s = 1.0  # "prefill" longer than first_byte_s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(UpstreamTimeoutError) as info:
            await client.send("r", "POST", url + "/slow", [], b"")
        assert not is_connect_failure(info.value)
        assert 0.25 < loop.time() - t0 < 0.9
        await asyncio.wait_for(script.disconnected.wait(), 3)  # the timed-out request's socket was closed
        # a stalled stream: the first event arrives, then nothing for longer than idle_read_s
        script.release.clear()
        resp = await client.send("r", "POST", url + "/sse", [], b"")
        chunks = resp.chunks().__aiter__()
        assert await anext(chunks) == b'data: {"n":1}\n\n'
        with pytest.raises(UpstreamTimeoutError):
            await anext(chunks)
        resp.abort()
        script.release.set()
    finally:
        await client.close()


async def test_abort_closes_the_socket(server: tuple[str, Script], client: ReplicaHttpClient) -> None:
    url, script = server
    resp = await client.send("r", "POST", url + "/slow", [], b"")
    chunks = resp.chunks().__aiter__()
    assert (await anext(chunks)).startswith(b"data: tick")
    resp.abort()  # what the gateway does when its own client goes away
    await asyncio.wait_for(script.disconnected.wait(), 3)
    resp = await client.send("r", "POST", url + "/echo", [], b"next")
    assert await _body(resp) == b"next"
    assert client.connections_opened == 2  # the aborted connection was never reused


async def test_cancelled_send_closes_the_socket(server: tuple[str, Script], client: ReplicaHttpClient) -> None:
    url, script = server
    script.delay_s = 0.3
    task = asyncio.create_task(client.send("r", "POST", url + "/slow", [], b""))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(script.disconnected.wait(), 3)
    assert client.stats()["open"] == 0


async def test_pool_is_bounded(server: tuple[str, Script]) -> None:
    url, script = server
    client = ReplicaHttpClient(TimeoutsConfig(first_byte_s=3.0), max_connections=2)
    try:
        script.release.clear()
        streams = [await client.send("r", "POST", url + "/sse", [], b"") for _ in range(2)]
        third = asyncio.create_task(client.send("r", "POST", url + "/echo", [], b"3rd"))
        await asyncio.sleep(0.2)
        assert not third.done()  # both connections are busy: it waits
        assert client.stats()["open"] == 2
        script.release.set()
        for resp in streams:
            await _body(resp)
        assert await _body(await asyncio.wait_for(third, 2)) == b"3rd"
        assert client.connections_opened == 2
    finally:
        await client.close()


async def test_per_replica_cap(server: tuple[str, Script]) -> None:
    url, script = server
    # first_byte_s bounds the second request's wait for the one connection; it also bounds the first
    # request's connect and status line, which a loaded CI machine has taken > 0.3 s to serve
    client = ReplicaHttpClient(
        TimeoutsConfig(first_byte_s=1.5), max_connections=10, max_connections_per_replica=1
    )
    try:
        script.release.clear()
        held = await client.send("r", "POST", url + "/sse", [], b"")
        with pytest.raises(UpstreamTimeoutError):
            await client.send("r", "POST", url + "/echo", [], b"")  # waits for the one connection
        held.abort()
        script.release.set()
    finally:
        await client.close()


@pytest.fixture
async def emulator() -> AsyncIterator[str]:
    config = EmulatorConfig(profile=get_profile("small-test"), time_scale=0.0001)
    reps = await start_emulators(1, config=config)
    yield reps[0].url
    await stop_emulators(reps)


def _chat(stream: bool) -> bytes:
    obj: dict[str, Any] = {
        "model": "emulated/small-test",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "stream": stream,
    }
    return json.dumps(obj).encode()


async def test_against_the_emulator(emulator: str, client: ReplicaHttpClient) -> None:
    hdrs = [("Content-Type", "application/json")]
    resp = await client.send("r", "POST", emulator + "/v1/chat/completions", hdrs, _chat(False))
    body = json.loads(await _body(resp))
    assert resp.status == 200 and body["usage"]["completion_tokens"] == 8
    resp = await client.send("r", "POST", emulator + "/v1/chat/completions", hdrs, _chat(True))
    assert resp.content_type.startswith("text/event-stream")
    raw = await _body(resp)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    status, metrics = await client.fetch("r", emulator + "/metrics")  # probes share the pool
    assert status == 200 and b"sglang:" in metrics
    assert client.connections_opened == 1


def test_under_uvloop(tmp_path: Any) -> None:
    """``kvroute serve`` runs on uvloop, whose transports are not ``asyncio.Transport`` subclasses."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> tuple[bytes, bytes, int]:
        script = Script()
        runner = web.AppRunner(_app(script))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        client = ReplicaHttpClient(TimeoutsConfig())
        try:
            a = await _body(await client.send("r", "POST", url + "/chunked", [], b""))
            b = await _body(await client.send("r", "POST", url + "/echo", [], b"uv"))
            return a, b, client.connections_opened
        finally:
            await client.close()
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        assert r.run(scenario()) == (_PAYLOAD, b"uv", 1)


async def test_closing_the_client_wakes_a_waiting_reader(server: tuple[str, Script]) -> None:
    url, script = server
    client = ReplicaHttpClient(TimeoutsConfig(idle_read_s=30.0))
    script.release.clear()
    resp = await client.send("r", "POST", url + "/sse", [], b"")
    chunks = resp.chunks().__aiter__()
    await anext(chunks)
    reader = asyncio.create_task(anext(chunks))  # waits for an event that never comes
    await asyncio.sleep(0.05)
    await client.close()
    with pytest.raises(UpstreamBrokenError):
        await asyncio.wait_for(reader, 2)  # at once, not after idle_read_s
    script.release.set()


async def test_fetch_shares_the_pool_and_maps_errors(
    server: tuple[str, Script], client: ReplicaHttpClient
) -> None:
    url, script = server
    assert await client.fetch("r", url + "/probe", accept="text/plain") == (200, b"ok text/plain")
    assert await client.fetch("r", url + "/probe?gz=1") == (200, b"")  # compressed: refused, not guessed
    resp = await client.send("r", "POST", url + "/echo", [], b"x")
    assert await _body(resp) == b"x"
    assert client.connections_opened == 1  # probes and requests on the same keep-alive connection
    script.delay_s = 1.0
    with pytest.raises(UpstreamTimeoutError):
        await client.fetch("r", url + "/probe", timeout_s=0.2)


async def test_https_replica(tmp_path: Any) -> None:
    """``https://`` replicas on the same client (TLS, host name checked); a certificate the client
    does not trust is a connect failure, never a request sent in the clear."""
    import ssl

    from loadtests.redis_server import make_self_signed_cert

    cert, key = make_self_signed_cert(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    seen: list[bytes] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(body=_PAYLOAD, content_type="application/json")

    app = web.Application()
    app.router.add_post("/x", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    url = f"https://127.0.0.1:{runner.addresses[0][1]}/x"
    trusting = ReplicaHttpClient(TimeoutsConfig(connect_s=2.0), ssl_context=ssl.create_default_context(cafile=cert))
    strict = ReplicaHttpClient(TimeoutsConfig(connect_s=2.0))  # the system's CA store only
    try:
        for _ in range(2):
            resp = await trusting.send("r", "POST", url, [("Content-Type", "application/json")], b'{"a":1}')
            assert resp.status == 200
            assert b"".join([c async for c in resp.chunks()]) == _PAYLOAD
            resp.release()
        assert seen == [b'{"a":1}', b'{"a":1}'] and trusting.connections_opened == 1
        with pytest.raises(UpstreamConnectError) as info:
            await strict.send("r", "POST", url, [], b"{}")
        assert is_connect_failure(info.value) and len(seen) == 2
    finally:
        await trusting.close()
        await strict.close()
        await runner.cleanup()
