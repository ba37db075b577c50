"""A small asyncio TCP proxy for fault tests: added latency per chunk, blackhole, cut connections.

``TcpProxy(target_host, target_port)`` listens on 127.0.0.1 (port 0 = free) and forwards bytes both
ways. While it runs a test may:

- ``latency_s = 0.05``: every chunk (each direction) is delayed that long before it is forwarded, so a
  request/response round trip costs at least ``2 * latency_s`` (ordering is kept per direction);
- ``blackhole = True``: accepted connections stay open but nothing is forwarded (bytes are read and
  dropped), the way a partitioned network looks to a client;
- ``cut_all()``: close every open connection (both sides), like a middlebox reset;
- ``refuse = True``: new connections are closed at once.

Nothing here is imported by the gateway; ``kvroute bench faults`` (``loadtests/faults.py``) and
``tests/hardening`` use it.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Self

__all__ = ["TcpProxy"]


@dataclass
class TcpProxy:
    target_host: str
    target_port: int
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    latency_s: float = 0.0
    blackhole: bool = False
    refuse: bool = False
    connections_total: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    _server: asyncio.Server | None = field(default=None, repr=False)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set, repr=False)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set, repr=False)

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        sock = self._server.sockets[0]
        return int(sock.getsockname()[1])

    @property
    def url_host_port(self) -> str:
        return f"{self.listen_host}:{self.port}"

    async def start(self) -> Self:
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.cut_all()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def open_connections(self) -> int:
        return len(self._writers) // 2

    def cut_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections_total += 1
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))
        t1 = asyncio.create_task(self._pipe(reader, up_w, up=True))
        t2 = asyncio.create_task(self._pipe(up_r, writer, up=False))
        for t in (t1, t2):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        await asyncio.wait({t1, t2}, return_when=asyncio.FIRST_COMPLETED)
        for w in (writer, up_w):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, up: bool) -> None:
        # A per-direction queue keeps byte order while each chunk waits out its own latency.
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def sender() -> None:
            while (item := await queue.get()) is not None:
                due, data = item
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()

        send_task = asyncio.create_task(sender())
        try:
            while data := await reader.read(65536):
                if self.blackhole:
                    continue
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                queue.put_nowait((loop.time() + self.latency_s, data))
                if send_task.done():
                    break
            queue.put_nowait(None)
            with contextlib.suppress(ConnectionError, OSError):
                await send_task
        except (ConnectionError, OSError):
            pass
        finally:
            send_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                await send_task
