"""Malformed responses from a replica: ``ReplicaHttpClient`` (router/gateway/upstream.py) against a raw
TCP server on 127.0.0.1 that writes scripted bytes.

Every case ends in a correct answer or in a ``router.errors.UpstreamError`` subclass - never another
exception, never a hang, never a connection left out of step with the server (the next request on the
pool still gets its own answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Self

import pytest

from router.config import TimeoutsConfig
from router.errors import (
    BadRequestError,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)
from router.gateway.forward import is_connect_failure
from router.gateway.upstream import MAX_FETCH_BYTES, MAX_HEAD_BYTES, MAX_HEADERS, ReplicaHttpClient

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


@dataclass
class Wire:
    """A raw HTTP/1.1 server: request ``i`` on the listener gets ``answers[i]`` (bytes, or a callable
    that writes to the stream itself); ``close_after`` closes the connection after that answer."""

    answers: list[bytes | Callable[[asyncio.StreamWriter], object]]
    close_after: set[int] = field(default_factory=set)
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    url: str = ""
    _server: asyncio.Server | None = None
    _writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                i = len(self.requests)
                self.requests.append(head + body)
                answer = self.answers[i] if i < len(self.answers) else OK
                if callable(answer):
                    done = answer(writer)
                    if asyncio.iscoroutine(done):
                        await done
                else:
                    writer.write(answer)
                await writer.drain()
                if i in self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:  # ends the connection handlers (they read EOF) before the loop closes
            w.transport.abort()
        await asyncio.sleep(0.01)


@pytest.fixture
async def client() -> AsyncIterator[ReplicaHttpClient]:
    c = ReplicaHttpClient(TimeoutsConfig(connect_s=1.0, first_byte_s=2.0, idle_read_s=2.0))
    yield c
    await c.close()


async def _exchange(client: ReplicaHttpClient, url: str) -> tuple[int, list[tuple[str, str]], bytes]:
    resp = await client.send("r", "POST", url + "/v1/completions", [("Content-Type", "application/json")], b"{}")
    body = b"".join([c async for c in resp.chunks()])
    resp.release()
    return resp.status, list(resp.headers), body


async def _fails(client: ReplicaHttpClient, url: str) -> UpstreamError:
    with pytest.raises(UpstreamError) as info:
        await _exchange(client, url)
    return info.value


async def _still_in_step(client: ReplicaHttpClient, wire: Wire) -> None:
    """The pool's next request gets its own answer (a broken connection was dropped, not reused)."""
    status, _, body = await asyncio.wait_for(_exchange(client, wire.url), 5)
    assert (status, body) == (200, b"ok")


# ---- the status line and the head ----------------------------------------------------------------

HEAD_ERRORS = {
    "bad status line": b"HTTX/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    "status out of range": b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    "status below 100": b"HTTP/1.1 99 Weird\r\nContent-Length: 0\r\n\r\n",
    "HTTP/2 preface": b"HTTP/2 200\r\n\r\n",
    "not HTTP at all": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "obs-fold header": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 2\r\n\r\nok",
    "NUL in a header value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 2\r\n\r\nok",
    "bare CR in a header value": b"HTTP/1.1 200 OK\r\nX-A: a\rSet-Cookie: x=1\r\nContent-Length: 2\r\n\r\nok",
    "space in a header name": b"HTTP/1.1 200 OK\r\nX A: b\r\nContent-Length: 2\r\n\r\nok",
    "Content-Length and Transfer-Encoding": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    ),
    "two different Content-Lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!",
    "negative Content-Length": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    "Content-Length overflow": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    "a coding other than chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "chunked not last": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nok",
    "an unasked protocol switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
    "too many headers": b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-%d: v\r\n" % i for i in range(MAX_HEADERS + 1))
    + b"Content-Length: 2\r\n\r\nok",
    "one huge header": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1) + b"\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("raw", HEAD_ERRORS.values(), ids=HEAD_ERRORS.keys())
async def test_a_bad_head_is_a_retryable_error_not_a_connect_failure(client: ReplicaHttpClient, raw: bytes) -> None:
    async with Wire([raw]) as wire:
        err = await _fails(client, wire.url)
        # nothing reached the client yet: retryable on another replica, but the replica is up
        assert isinstance(err, UpstreamConnectError) and err.retryable and not is_connect_failure(err)
        await _still_in_step(client, wire)
    assert wire.connections == 2  # the bad connection was closed, never reused


async def test_a_head_that_never_ends_is_cut_at_the_limit(client: ReplicaHttpClient) -> None:
    async def trickle(w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        for _ in range(4 * MAX_HEAD_BYTES // 4096):
            w.write(b"a" * 4096)
            await w.drain()
            await asyncio.sleep(0)

    async with Wire([trickle]) as wire:
        err = await _fails(client, wire.url)
        assert isinstance(err, UpstreamConnectError) and "head over" in str(err)


async def test_a_server_that_stops_mid_head_times_out(client: ReplicaHttpClient) -> None:
    quick = ReplicaHttpClient(TimeoutsConfig(connect_s=0.2, first_byte_s=0.3, idle_read_s=0.3))
    try:
        async with Wire([b"HTTP/1.1 200 OK\r\nContent-Len"]) as wire:
            err = await _fails(quick, wire.url)
            assert isinstance(err, UpstreamTimeoutError)
    finally:
        await quick.close()


async def test_a_close_before_the_head_is_retryable(client: ReplicaHttpClient) -> None:
    async with Wire([b"HTTP/1.1 200 OK\r\n"], close_after={0}) as wire:
        err = await _fails(client, wire.url)
        assert isinstance(err, UpstreamConnectError) and not is_connect_failure(err)


# ---- bodies --------------------------------------------------------------------------------------

BODY_ERRORS = {
    "bad chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
    "chunk size overflow": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffffff\r\nok",
    "chunk without its CRLF": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n",
    "NUL in a chunk extension": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;\x00\r\nok\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("raw", BODY_ERRORS.values(), ids=BODY_ERRORS.keys())
async def test_a_bad_body_is_broken(client: ReplicaHttpClient, raw: bytes) -> None:
    async with Wire([raw]) as wire:
        err = await _fails(client, wire.url)
        assert isinstance(err, UpstreamBrokenError) and not err.retryable
        await _still_in_step(client, wire)
    assert wire.connections == 2


TRUNCATED = {
    "Content-Length body cut short": b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello",
    "chunked body cut short": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    "chunked body cut mid-chunk": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\nhel",
}


@pytest.mark.parametrize("raw", TRUNCATED.values(), ids=TRUNCATED.keys())
async def test_a_truncated_body_is_broken(client: ReplicaHttpClient, raw: bytes) -> None:
    async with Wire([raw], close_after={0}) as wire:
        resp = await client.send("r", "POST", wire.url + "/x", [], b"{}")
        got = b""
        with pytest.raises(UpstreamBrokenError):
            async for chunk in resp.chunks():
                got += chunk
        assert b"hello".startswith(got) or got.startswith(b"hel")  # what arrived was handed on
        resp.abort()
        await _still_in_step(client, wire)


async def test_a_body_delimited_by_close_ends_with_the_connection(client: ReplicaHttpClient) -> None:
    async with Wire([b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it"], close_after={0}) as wire:
        resp = await client.send("r", "POST", wire.url + "/x", [], b"{}")
        assert resp.content_length is None
        assert b"".join([c async for c in resp.chunks()]) == b"all of it"
        resp.release()
        await _still_in_step(client, wire)
    assert wire.connections == 2  # HTTP/1.0 without keep-alive: not reused


async def test_a_probe_answer_without_end_is_cut_at_the_limit(client: ReplicaHttpClient) -> None:
    """``fetch`` reads a probe whole: an answer past ``MAX_FETCH_BYTES`` is refused as soon as it
    passes it, not buffered for as long as the probe's timeout lets it stream."""
    sent = 0

    async def flood(w: asyncio.StreamWriter) -> None:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (8 * MAX_FETCH_BYTES))
        chunk = b"m" * (1 << 20)
        with contextlib.suppress(ConnectionError):
            while sent < 8 * MAX_FETCH_BYTES:
                w.write(chunk)
                await w.drain()
                sent += len(chunk)

    async with Wire([flood]) as wire:
        with pytest.raises(UpstreamBrokenError, match="over"):
            await client.fetch("r", wire.url + "/metrics", timeout_s=30.0)
        assert sent < 4 * MAX_FETCH_BYTES  # cut, not read to the end
        await _still_in_step(client, wire)


# ---- interim and bodiless answers ------------------------------------------------------------------


async def test_interim_answers_are_skipped(client: ReplicaHttpClient) -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Final: 1\r\n\r\nfinal"
    )
    async with Wire([raw]) as wire:
        status, headers, body = await _exchange(client, wire.url)
        assert (status, body) == (200, b"final")
        names = {k.lower() for k, _ in headers}
        assert "x-final" in names and "link" not in names  # the hints' headers are not the answer's
        await _still_in_step(client, wire)
    assert wire.connections == 1  # kept alive and in step


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n",  # a length, and no body all the same
        b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
    ],
    ids=["204 with a length", "304 chunked", "204 plain"],
)
async def test_bodiless_answers_have_no_body_and_keep_the_connection_in_step(
    client: ReplicaHttpClient, raw: bytes
) -> None:
    async with Wire([raw]) as wire:
        resp = await client.send("r", "POST", wire.url + "/x", [], b"{}")
        assert resp.status in (204, 304) and resp.content_length == 0
        assert b"".join([c async for c in resp.chunks()]) == b""
        resp.release()
        await _still_in_step(client, wire)
    assert wire.connections == 1


async def test_bytes_after_the_answer_take_the_connection_out_of_the_pool(client: ReplicaHttpClient) -> None:
    async with Wire([OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra"]) as wire:
        assert (await _exchange(client, wire.url))[2] == b"ok"
        await asyncio.sleep(0.05)  # the extra answer arrives while the connection is pooled
        await _still_in_step(client, wire)
    assert wire.connections == 2


# ---- header values, both ways ---------------------------------------------------------------------


async def test_a_header_value_that_is_not_utf8_arrives_replaced(client: ReplicaHttpClient) -> None:
    async with Wire([b"HTTP/1.1 200 OK\r\nX-Odd: a\xffb\r\nContent-Length: 2\r\n\r\nok"]) as wire:
        _, headers, body = await _exchange(client, wire.url)
        assert ("X-Odd", "a\ufffdb") in headers and body == b"ok"
        # the value can be written out again as UTF-8 (what the gateway's server does)
        assert "a\ufffdb".encode() == b"a\xef\xbf\xbdb"


@pytest.mark.parametrize(
    "header",
    [("X-A", "v\r\nX-Injected: 1"), ("X-A", "v\nX-Injected: 1"), ("X-A", "v\r"), ("X-A", "v\x00"), ("X\r\nB", "v")],
    ids=["CRLF in a value", "LF in a value", "CR in a value", "NUL in a value", "CRLF in a name"],
)
async def test_a_request_header_with_a_line_break_is_never_written(
    client: ReplicaHttpClient, header: tuple[str, str]
) -> None:
    async with Wire([OK]) as wire:
        with pytest.raises(BadRequestError):
            await client.send("r", "POST", wire.url + "/x", [header], b"{}")
        await _still_in_step(client, wire)
    assert len(wire.requests) == 1 and b"X-Injected" not in wire.requests[0]


async def test_a_url_that_is_not_http_is_refused(client: ReplicaHttpClient) -> None:
    with pytest.raises(UpstreamConnectError):
        await client.send("r", "POST", "ftp://127.0.0.1:1/x", [], b"")
