"""The gateway's HTTP client towards replicas: HTTP/1.1 keep-alive connections on asyncio ``Protocol``
objects, responses parsed by ``httptools`` (llhttp), behind the ``ReplicaClient`` / ``UpstreamResponse``
seam of ``forward.py``. It writes one buffer per request and parses with one C call per
``data_received``: about two thirds of the CPU aiohttp's client spends per proxied request
(docs/BENCHMARKS.md). A replica is a trusted peer, but its answers are still checked: a malformed
response is a typed error, never a hang or a foreign exception (tests/router/test_upstream_malformed.py).

Rules:
  1. Bodies byte for byte: the request body is written as given (one ``write`` with the head); the
     response body is handed on as it arrives (chunked transfer coding removed, nothing else
     touched). Hop-by-hop headers are the caller's business (``filter_*_headers``); this module
     adds exactly ``Host`` and ``Content-Length``. A header name or value with CR, LF or NUL is
     never written (``BadRequestError``).
  2. One request at a time per connection (no pipelining). A connection goes back to its replica's
     idle list only when its response was read to the end, the server did not ask to close it
     (``Connection: close``, HTTP/1.0) and no error happened on it. An idle connection older than
     ``KEEPALIVE_S`` is closed instead of reused (uvicorn, SGLang's server, closes idle connections
     after 5 s: reusing one at that moment fails the request).
  3. Closing an unfinished response closes its socket: that is how a client's disconnect reaches
     the engine (SGLang aborts the request when its connection drops).
  4. The pool is bounded: ``max_connections`` open connections in total and
     ``max_connections_per_replica`` per replica (0 = no per-replica cap); a request that finds the
     pool full waits for a connection (within its first-byte timeout), closing an idle connection of
     another replica first if there is one.
  5. Errors are ``router.errors`` from the start (this module is the boundary for its own socket and
     parser errors): a failed connect raises ``UpstreamConnectError`` caused by
     ``forward.ConnectFailure`` (``is_connect_failure`` is true: it counts towards passive
     ejection); a response that is not HTTP/1.x (bad status line, a head over ``MAX_HEAD_BYTES`` or
     ``MAX_HEADERS``, a transfer coding other than ``chunked``, a protocol switch nobody asked for)
     or a reused connection that drops before the response is ``UpstreamConnectError`` without it;
     a body that breaks off or is malformed is ``UpstreamBrokenError``; every timeout is
     ``UpstreamTimeoutError``.
  6. Framing is llhttp's: interim 1xx answers are skipped, 204 and 304 have no body whatever their
     headers say, Content-Length with Transfer-Encoding or twice with different values is an error.
     Header values that are not UTF-8 are passed on with U+FFFD in place of the bad bytes.
  7. Timeouts: ``connect_s`` per new connection, ``first_byte_s`` from ``send`` to the status line
     (connect and pool wait included) and, for what is left of it, to the first body chunk;
     ``idle_read_s`` between later chunks.
  8. ``http://`` and ``https://`` (TLS with the system's CA store and host name check). The small
     ``fetch`` probes (health, metrics, models) share the pool, so ``max_connections`` bounds every
     connection to the replicas. A probe is read whole, up to ``MAX_FETCH_BYTES`` (past it:
     ``UpstreamBrokenError``, the connection closed).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Sequence
from typing import Any, cast

import httptools

from router.config import TimeoutsConfig
from router.errors import (
    BadRequestError,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)
from router.gateway.forward import ConnectFailure, UpstreamResponse, read_limited

__all__ = ["KEEPALIVE_S", "MAX_FETCH_BYTES", "MAX_HEADERS", "MAX_HEAD_BYTES", "READ_BUFFER_BYTES", "ReplicaHttpClient"]

KEEPALIVE_S = 4.0
"""An idle pooled connection older than this is closed rather than reused (rule 2)."""

READ_BUFFER_BYTES = 256 * 1024
"""Body bytes buffered before the socket stops being read (the client reads slower than the replica writes)."""

MAX_HEAD_BYTES = 64 * 1024
"""A response head (status line + headers) longer than this is refused (rule 5)."""

MAX_HEADERS = 256
"""A response with more header lines than this is refused (rule 5)."""

MAX_FETCH_BYTES = 16 * 1024 * 1024
"""A probe's answer (``fetch``: /metrics, /server_info, a stored response) longer than this is cut
and refused: a probe is read whole into memory (SGLang's largest, /metrics, is tens of kB)."""

_IDLE, _HEAD, _BODY, _DONE, _CLOSED = range(5)
_NO_BODY = frozenset({204, 304})


class _Origin:
    """What is fixed per replica base URL: address, TLS, Host header, pool key."""

    __slots__ = ("host", "host_header", "key", "port", "tls")

    def __init__(self, host: str, port: int, host_header: bytes, tls: bool) -> None:
        self.host = host
        self.port = port
        self.host_header = host_header
        self.tls = tls
        self.key = (host, port, tls)


def _origin(base: str) -> _Origin:
    # base = "http[s]://host[:port]"
    tls = base.startswith("https://")
    netloc = base[8:] if tls else base[7:]
    default = 443 if tls else 80
    if netloc.startswith("["):  # IPv6 literal
        end = netloc.index("]")
        host = netloc[1:end]
        rest = netloc[end + 1 :]
        port = int(rest[1:]) if rest.startswith(":") else default
    else:
        host, _, p = netloc.partition(":")
        port = int(p) if p else default
    return _Origin(host, port, netloc.encode("idna" if not netloc.isascii() else "ascii"), tls)


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a replica; carries at most one exchange at a time."""

    __slots__ = (
        "_body_waiter",
        "_buffered",
        "_chunked",
        "_chunks",
        "_cl",
        "_error",
        "_head_bytes",
        "_head_waiter",
        "_header_bytes",
        "_headers",
        "_loop",
        "_parser",
        "_paused",
        "_pool",
        "_state",
        "idle_since",
        "keep_alive",
        "key",
        "status",
        "transport",
    )

    def __init__(
        self, pool: ReplicaHttpClient, key: tuple[str, int, bool], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._pool = pool
        self.key = key
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._headers: list[tuple[str, str]] = []
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._head_waiter: asyncio.Future[None] | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._cl: int | None = None
        self._chunked = False
        self._head_bytes = 0  # bytes received while the head is incomplete
        self._header_bytes = 0  # header lines parsed
        self.status = 0
        self.keep_alive = False
        self.idle_since = 0.0

    @property
    def where(self) -> str:
        return f"replica {self.key[0]}:{self.key[1]}"

    # ---- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._state not in (_HEAD, _BODY):
            # bytes after the end of the response or while pooled: the response read is intact,
            # but the connection is out of step with the server and never reused
            self.keep_alive = False
            if self._state == _IDLE:
                self.close()
            return
        head = self._state == _HEAD
        try:
            self._parser.feed_data(data)
            if head and self._state == _HEAD:
                # a head still incomplete: llhttp buffers it, so it is bounded here (rule 5)
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    raise _BadResponse(f"response head over {MAX_HEAD_BYTES} bytes")
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, _BadResponse) as exc:
            if isinstance(exc.__context__, _Unasked):
                return  # the answer read is intact; the connection is out of step: never reused
            cause = exc.__context__ if isinstance(exc.__context__, _BadResponse) else exc
            if isinstance(exc, httptools.HttpParserUpgrade):
                cause = _BadResponse("the replica switched protocols")
            err: UpstreamError
            if self._state == _HEAD:
                err = UpstreamConnectError(f"{self.where}: bad HTTP response: {cause}")
            else:
                err = UpstreamBrokenError(f"{self.where}: bad HTTP body: {cause}")
            err.__cause__ = cause
            self._fail(err)
            self.close()
            return
        if self._buffered > READ_BUFFER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        state = self._state
        self._state = _CLOSED
        if state == _BODY and self._cl is None and not self._chunked:
            self._state = _DONE  # a body delimited by the end of the connection has ended
            self.keep_alive = False
            self._wake_body()
        elif state in (_HEAD, _BODY):
            where = self.where
            err: UpstreamError
            if state == _HEAD:
                # a reused keep-alive connection the server closed at the wrong moment: retryable,
                # but says nothing about the replica's health (not a ConnectFailure)
                err = UpstreamConnectError(f"{where}: server disconnected")
            else:
                err = UpstreamBrokenError(f"{where}: response broke off")
            err.__cause__ = exc or ConnectionResetError("connection closed")
            self._fail(err)
        self._pool._closed(self)

    # ---- httptools callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state == _DONE:  # a second answer in the same read as the first: nobody asked for it
            self.keep_alive = False
            raise _Unasked

    def on_header(self, name: bytes, value: bytes) -> None:
        # a head that arrives in one read is parsed whole before data_received can count it
        self._header_bytes += len(name) + len(value) + 4
        if self._header_bytes > MAX_HEAD_BYTES:
            raise _BadResponse(f"response head over {MAX_HEAD_BYTES} bytes")
        if len(self._headers) >= MAX_HEADERS:
            raise _BadResponse(f"more than {MAX_HEADERS} response headers")
        n = name.decode("latin-1")  # llhttp admits only token characters in names
        self._headers.append((n, value.decode("utf-8", "replace")))
        low = n.lower()
        if low == "content-length":
            self._cl = int(value)  # llhttp has checked the digits and refused a second, different one
        elif low == "transfer-encoding":
            if value.strip().lower() != b"chunked":
                # another coding would reach the client undecoded, without the header naming it
                raise _BadResponse(f"unsupported transfer coding {value[:64]!r}")
            self._chunked = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self.status < 200:  # 1xx: interim, the real response follows (we never ask for one)
            self._headers = []
            self._cl = None
            self._chunked = False
            self._head_bytes = self._header_bytes = 0
            return
        if self.status in _NO_BODY:  # no body whatever the headers say (llhttp agrees)
            self._cl, self._chunked = 0, False
        self.keep_alive = self._parser.should_keep_alive()
        self._state = _BODY
        w = self._head_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake_body()

    def on_message_complete(self) -> None:
        if self._state != _BODY:
            return  # the end of a 1xx response
        self._state = _DONE
        self._wake_body()

    # ---- used by the response ----------------------------------------------------------------------

    def _wake_body(self) -> None:
        w = self._body_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: UpstreamError) -> None:
        if self._error is None:
            self._error = err
        for w in (self._head_waiter, self._body_waiter):
            if w is not None and not w.done():
                w.set_result(None)

    def start(self, head: bytes, body: bytes) -> None:
        self._state = _HEAD
        self._headers = []
        self._chunks.clear()
        self._buffered = 0
        self._error = None
        self._cl = None
        self._chunked = False
        self._head_bytes = self._header_bytes = 0
        self.status = 0
        self._head_waiter = self._loop.create_future()
        assert self.transport is not None
        if len(body) <= 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))

    async def wait_head(self, deadline: float) -> None:
        w = self._head_waiter
        assert w is not None
        if not w.done():
            timer = self._loop.call_at(deadline, _expire, w)
            try:
                await w
            finally:
                timer.cancel()
        self._head_waiter = None
        if self._state != _BODY and self._state != _DONE:
            if self._error is not None:
                raise self._error
            raise UpstreamTimeoutError(f"{self.where}: no response in time")

    def take(self) -> bytes | None:
        """All buffered body bytes, ``b""`` if none yet, ``None`` at the end of the body."""
        chunks = self._chunks
        if chunks:
            data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            self._buffered = 0
            if self._paused and self.transport is not None:
                self._paused = False
                self.transport.resume_reading()
            return data
        if self._error is not None:
            raise self._error
        if self._state == _DONE:
            return None
        if self._state == _CLOSED:
            raise UpstreamBrokenError(f"{self.where}: connection closed")
        return b""

    async def wait_body(self, timeout_s: float) -> None:
        w = self._body_waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout_s, _expire, w)
        try:
            await w
        finally:
            timer.cancel()
            self._body_waiter = None
        if not self._chunks and self._error is None and self._state == _BODY:
            raise UpstreamTimeoutError(
                f"{self.where}: no data for {timeout_s:.3g} s (timed out)"
            )

    def finish(self) -> None:
        """The exchange is over: back to the pool if reusable, else closed."""
        if self._state == _DONE and self.keep_alive and self._error is None and not self._chunks:
            self._state = _IDLE
            self._pool._release(self)
        else:
            self.close()

    def close(self) -> None:
        state = self._state
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        if state != _CLOSED:
            self._state = _CLOSED
            if state == _HEAD:  # closed under a waiting request (client shut down): wake it
                self._fail(UpstreamConnectError(f"{self.where}: connection closed"))
            elif state == _BODY:
                self._fail(UpstreamBrokenError(f"{self.where}: connection closed"))
            self._pool._closed(self)

    @property
    def usable(self) -> bool:
        t = self.transport
        return self._state == _IDLE and t is not None and not t.is_closing()


class _BadResponse(Exception):
    """Raised while parsing: the response breaks a rule llhttp does not check (module rule 5)."""


class _Unasked(Exception):
    """Raised while parsing: bytes of another answer follow the one asked for (stops the parser)."""


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)  # the waiter sees no progress and raises its timeout


class _RawUpstream:
    """``UpstreamResponse`` over one ``_Connection``."""

    __slots__ = ("_conn", "_finished", "_first", "_first_s", "_idle_s", "headers", "status")

    def __init__(self, conn: _Connection, idle_s: float, first_s: float) -> None:
        self._conn = conn
        self._idle_s = idle_s
        self._first_s = first_s
        self._first = True
        self._finished = False
        self.status = conn.status
        self.headers: Sequence[tuple[str, str]] = conn._headers

    @property
    def content_type(self) -> str:
        for k, v in self.headers:
            if k.lower() == "content-type":
                return v
        return ""

    @property
    def content_length(self) -> int | None:
        c = self._conn
        return None if c._chunked else c._cl

    def chunks(self) -> _RawUpstream:
        return self

    def __aiter__(self) -> _RawUpstream:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            data = conn.take()
            if data is None:
                raise StopAsyncIteration
            if data:
                self._first = False
                return data
            await conn.wait_body(self._first_s if self._first else self._idle_s)

    def at_eof(self) -> bool:
        c = self._conn
        return c._state == _DONE and not c._chunks

    async def read(self, limit: int) -> bytes:
        return await read_limited(self, limit)

    def release(self) -> None:
        if not self._finished:
            self._finished = True
            self._conn.finish()

    def abort(self) -> None:
        if not self._finished:
            self._finished = True
            self._conn.close()


class ReplicaHttpClient:
    """``ReplicaClient`` on a pool of ``httptools`` connections (create inside a running loop).

    ``ssl_context``: for ``https://`` replicas (default: the system's CA store, host names checked)."""

    def __init__(
        self,
        timeouts: TimeoutsConfig,
        *,
        max_connections: int = 1024,
        max_connections_per_replica: int = 0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._timeouts = timeouts
        self._max = max_connections
        self._max_per = max_connections_per_replica
        self._loop = asyncio.get_running_loop()
        self._ssl = ssl_context
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: dict[tuple[str, int, bool], int] = {}
        self._total = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._all: set[_Connection] = set()
        self._closed_client = False
        self.connections_opened = 0  # for tests and stats: new TCP connections made

    # ---- pool --------------------------------------------------------------------------------------

    def _release(self, conn: _Connection) -> None:
        if self._closed_client:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._waiters:
            self._wake_all()

    def _closed(self, conn: _Connection) -> None:
        if conn in self._all:
            self._all.discard(conn)
            self._total -= 1
            self._open[conn.key] -= 1
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake_all()

    def _wake_all(self) -> None:
        # every waiter looks again (they may wait for different replicas); only a full pool has any
        waiters, self._waiters = self._waiters, collections.deque()
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def _evict_idle_elsewhere(self, key: tuple[str, int, bool]) -> bool:
        for k, conns in self._idle.items():
            if k != key and conns:
                conns[0].close()  # oldest first
                return True
        return False

    async def _acquire(self, origin: _Origin, deadline: float) -> _Connection:
        key = origin.key
        loop = self._loop
        while True:
            idle = self._idle.get(key)
            if idle:
                now = loop.time()
                while idle:
                    conn = idle.pop()  # most recently used first: the warmest, least likely closed
                    if conn.usable and now - conn.idle_since < KEEPALIVE_S:
                        return conn
                    conn.close()
            if self._max_per <= 0 or self._open.get(key, 0) < self._max_per:
                if self._total >= self._max:
                    self._evict_idle_elsewhere(key)
                if self._total < self._max:
                    return await self._connect(origin, deadline)
            w = loop.create_future()
            self._waiters.append(w)
            timer = loop.call_at(deadline, _expire, w)
            try:
                await w
            finally:
                timer.cancel()
            if loop.time() >= deadline:
                raise UpstreamTimeoutError(
                    f"replica {origin.host}:{origin.port}: no free upstream connection in time"
                )

    async def _connect(self, origin: _Origin, deadline: float) -> _Connection:
        key = origin.key
        conn = _Connection(self, key, self._loop)
        self._all.add(conn)
        self._total += 1
        self._open[key] = self._open.get(key, 0) + 1
        where = f"replica {origin.host}:{origin.port}"
        timeout = min(self._timeouts.connect_s, max(0.0, deadline - self._loop.time()))
        tls: dict[str, Any] = {}
        if origin.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            tls = {"ssl": self._ssl, "server_hostname": origin.host}
        try:
            async with asyncio.timeout(timeout):
                await self._loop.create_connection(lambda: conn, origin.host, origin.port, **tls)
        except TimeoutError as exc:
            self._closed(conn)
            if conn.transport is not None:
                conn.transport.abort()
            raise UpstreamConnectError(f"{where}: connect timed out") from ConnectFailure(str(exc))
        except OSError as exc:
            self._closed(conn)
            raise UpstreamConnectError(f"{where}: cannot connect: {exc}") from ConnectFailure(str(exc))
        except BaseException:
            self._closed(conn)
            if conn.transport is not None:
                conn.transport.abort()
            raise
        self.connections_opened += 1
        return conn

    # ---- ReplicaClient -----------------------------------------------------------------------------

    async def _exchange(
        self, url: str, method: str, headers: Sequence[tuple[str, str]], body: bytes, deadline: float
    ) -> _Connection:
        """Send one request on a pooled connection; returns it once the status line and headers
        arrived (by ``deadline``, loop time)."""
        if url.startswith("http://"):
            cut = url.find("/", 7)
        elif url.startswith("https://"):
            cut = url.find("/", 8)
        else:
            raise UpstreamConnectError(f"replica URL {url[:64]!r}: not http:// or https://")
        base, path = (url, "/") if cut < 0 else (url[:cut], url[cut:])
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = _origin(base)
        head = "".join([f"{k}: {v}\r\n" for k, v in headers])
        n = len(headers)
        if head.count("\n") != n or head.count("\r") != n or "\x00" in head:  # one CRLF per line (rule 1)
            raise BadRequestError("a header name or value holds a line break or NUL; not forwarded")
        raw_head = b"".join(
            (
                f"{method} {path} HTTP/1.1\r\nHost: ".encode(),
                origin.host_header,
                f"\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode("utf-8", "surrogateescape"),
            )
        )
        conn = await self._acquire(origin, deadline)
        try:
            conn.start(raw_head, body)
            await conn.wait_head(deadline)
        except BaseException:
            # an error, a timeout, or cancelled (the client left): the engine sees the connection drop
            conn.close()
            raise
        return conn

    async def send(
        self, replica_id: str, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        t = self._timeouts
        deadline = self._loop.time() + t.first_byte_s
        conn = await self._exchange(url, method, headers, body, deadline)
        # as with aiohttp: the first chunk gets what is left of first_byte_s (at least connect_s)
        left = max(t.connect_s, deadline - self._loop.time())
        return _RawUpstream(conn, t.idle_read_s, left)

    async def fetch(
        self, replica_id: str, url: str, *, accept: str | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """Probes ride the same bounded pool as requests (``max_connections`` counts every
        connection to the replicas)."""
        limit = timeout_s or self._timeouts.probe_s
        deadline = self._loop.time() + limit
        conn = await self._exchange(url, "GET", [("Accept", accept)] if accept else [], b"", deadline)
        resp = _RawUpstream(conn, limit, limit)
        try:
            async with asyncio.timeout_at(deadline):
                parts, size = [], 0
                async for chunk in resp:
                    size += len(chunk)
                    if size > MAX_FETCH_BYTES:
                        raise UpstreamBrokenError(f"replica {replica_id}: answer over {MAX_FETCH_BYTES} bytes")
                    parts.append(chunk)
                body = b"".join(parts)
        except TimeoutError:
            resp.abort()
            raise UpstreamTimeoutError(f"replica {replica_id}: probe timed out") from None
        except BaseException:
            resp.abort()
            raise
        resp.release()
        encoding = next((v for k, v in resp.headers if k.lower() == "content-encoding"), "identity")
        if encoding not in ("identity", ""):
            body = b""  # probes never ask for compression; refuse to guess
        return resp.status, body

    async def close(self) -> None:
        self._closed_client = True
        for conn in list(self._all):
            conn.close()

    def stats(self) -> dict[str, Any]:
        return {
            "open": self._total,
            "idle": sum(len(v) for v in self._idle.values()),
            "opened_total": self.connections_opened,
        }
