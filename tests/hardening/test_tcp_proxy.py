"""The test TCP proxy itself: bytes pass both ways in order, latency is added, blackhole and cut work."""

from __future__ import annotations

import asyncio
import time

import pytest

from loadtests.tcp_proxy import TcpProxy


async def _echo_server() -> asyncio.Server:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_relay_latency_blackhole_and_cut() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    async with TcpProxy("127.0.0.1", port) as proxy:
        r, w = await asyncio.open_connection("127.0.0.1", proxy.port)
        payload = bytes(range(256)) * 1000
        w.write(payload)
        await w.drain()
        assert await asyncio.wait_for(r.readexactly(len(payload)), 5) == payload  # order kept
        proxy.latency_s = 0.05
        t0 = time.monotonic()
        w.write(b"ping")
        await w.drain()
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"ping"
        assert time.monotonic() - t0 >= 0.1  # 50 ms each way
        proxy.latency_s = 0.0
        proxy.blackhole = True
        w.write(b"lost")
        await w.drain()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(r.read(4), 0.3)
        proxy.blackhole = False
        assert proxy.open_connections == 1
        proxy.cut_all()
        assert await asyncio.wait_for(r.read(10), 5) == b""  # the client sees the connection end
        w.close()
        proxy.refuse = True
        r2, w2 = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(r2.read(10), 5) == b""
        w2.close()
        assert proxy.connections_total == 2 and proxy.bytes_up >= len(payload) + 4
    server.close()
    await server.wait_closed()
