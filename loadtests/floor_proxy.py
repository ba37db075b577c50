"""``python -m loadtests.floor_proxy --port P --replica URL``: the floor of a Python proxy.

A reference point for ``kvroute bench overhead`` (target ``python-floor``), not a router: uvloop,
an ``httptools`` server protocol and kvroute's own upstream client (``router.gateway.upstream``),
forwarding every request to one replica with no routing, no state, no limits, no metrics. What it
adds over talking to the replica directly is what any Python gateway on this interpreter and machine
pays before doing any work of its own; kvroute's added latency minus this is kvroute's own cost.

Rules:
  1. Bench only: requests are handled one at a time per connection (HTTP/1.1 clients do not
     pipeline), write back-pressure is ignored, bodies are whole in memory.
  2. ``GET /ready`` answers 200 itself (the bench's readiness check); everything else is forwarded.
  3. A response of known length keeps it; anything else (SSE) is relayed chunk by chunk with
     ``Transfer-Encoding: chunked``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import cast

import httptools

from router.config import TimeoutsConfig
from router.errors import UpstreamError
from router.eventloop import event_loop_factory
from router.gateway.forward import filter_request_headers, filter_response_headers
from router.gateway.upstream import ReplicaHttpClient

__all__ = ["cli_main"]


class _FloorProtocol(asyncio.Protocol):
    def __init__(self, client: ReplicaHttpClient, replica: str) -> None:
        self.client = client
        self.replica = replica
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        keep_alive = self.parser.should_keep_alive()
        asyncio.get_running_loop().create_task(
            self._handle(method, self.url.decode("latin-1"), self.headers, b"".join(self.body), keep_alive)
        )

    async def _handle(
        self, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes, keep_alive: bool
    ) -> None:
        t = self.transport
        assert t is not None
        if method == "GET" and path == "/ready":
            t.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        else:
            try:
                up = await self.client.send(
                    "r0", method, self.replica + path, filter_request_headers(headers), body
                )
            except UpstreamError as exc:  # a bench tool: say why, close
                msg = str(exc).encode()
                t.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\n\r\n%s" % (len(msg), msg))
                t.close()
                return
            head = "".join(f"{k}: {v}\r\n" for k, v in filter_response_headers(up.headers))
            length = up.content_length
            framing = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
            t.write(f"HTTP/1.1 {up.status} X\r\n{head}{framing}\r\n\r\n".encode("latin-1"))
            async for chunk in up.chunks():
                t.write(chunk if length is not None else b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if length is None:
                t.write(b"0\r\n\r\n")
            up.release()
        if not keep_alive:
            t.close()


async def _serve(port: int, replica: str) -> None:
    client = ReplicaHttpClient(TimeoutsConfig.model_validate({}))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _FloorProtocol(client, replica.rstrip("/")), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def cli_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.floor_proxy", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replica", required=True, help="http://host:port of the one replica")
    ns = p.parse_args(argv)
    with asyncio.Runner(loop_factory=event_loop_factory({})) as runner:
        runner.run(_serve(ns.port, ns.replica))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main())
