"""The raw data plane: the gateway's listener, an HTTP/1.1 server on asyncio protocols + ``httptools``
that serves the inference routes itself and hands every other request to aiohttp.

Why: at c=1 the gateway's added latency was mostly aiohttp's server side, not routing. Between a
request's bytes arriving and its forward leaving, aiohttp spent ~75 µs (parser output to a request
object, two loop hops for a per-request task, the router, the middleware chain) and a bare
``httptools`` proxy ~15 µs; the response path has the same shape. ``downstream.server: raw`` (the
default) puts the inference routes on this module; ``aiohttp`` serves everything on aiohttp as
before. docs/BENCHMARKS.md round 12 has the measurements.

Rules:
  1. One :class:`DataPlaneProtocol` per client connection. Its requests are served one at a time,
     in order; pipelined requests queue (reading pauses once ``_MAX_QUEUED`` wait, or their bodies
     add up to more than ``max_body_bytes``).
  2. ``POST`` to an inference route (the request target's path exactly ``INFERENCE_ROUTES``, query
     ignored) runs :func:`router.gateway.handlers.serve_inference` with the connection as its
     ``Downstream``: the same routing, retries, events and errors as on aiohttp's server.
  3. Any other request hands the connection to aiohttp for good. The request is re-serialised
     (body whole, with ``Content-Length``; ``Expect`` already answered) and fed to aiohttp's
     ``RequestHandler``, which takes the transport itself (``transport.set_protocol``) as soon as
     this parser stands at a message boundary. Admin API, dashboard, ``/metrics``, ``/health``,
     ``/v1/models``, 404s and 405s: all aiohttp's, with its middlewares.
  4. Limits as on aiohttp's server (``limits.*``): request line over ``max_line_size``, a header
     line (name + value) over ``max_field_size``, more than ``max_headers`` headers, or bytes that
     are not HTTP get 400 ``bad_http_request``; a body over ``max_body_bytes`` gets 413 (a declared
     length before a byte of it is read, a chunked body once it crosses). Both as OpenAI-style JSON;
     then the connection closes, lingering (what the client still sends is read and dropped for a
     while, so the answer is not lost to a reset). A request head that keeps growing is cut at the
     sum of those limits, so the parser never buffers more.
  5. A client that disconnects cancels its request's task (aiohttp's ``handler_cancellation``):
     the upstream response is closed at once and the lease released (``handlers`` rule 3).
  6. Keep-alive as HTTP/1.1 says (``httptools``' ``should_keep_alive``); a connection with no
     request being served is closed after ``keepalive_s`` without a byte (counted from its last
     response or its start; aiohttp: 75 s), or when a request head begun ``keepalive_s`` ago is
     still not whole (a head trickled a byte at a time). While the gateway shuts down, answers
     carry ``Connection: close``.
  7. Status and headers leave with the first body bytes; chunked framing for bodies of unknown
     length on HTTP/1.1 (HTTP/1.0: delimited by closing the connection). ``write`` waits while the
     transport is paused (its buffer over the high-water mark).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict

from router.errors import KvrouteError, PayloadTooLargeError
from router.gateway.handlers import INFERENCE_ROUTES, serve_inference
from router.gateway.middleware import (
    REQUEST_ID_HEADER,
    GatewayMiddleware,
    error_payload,
    kvroute_error_status,
    request_id_for,
)
from router.observability.logging import set_request_id

if TYPE_CHECKING:
    from aiohttp.web_protocol import RequestHandler

    from router.gateway.keys import GatewayRuntime

__all__ = ["DataPlane", "DataPlaneProtocol", "DataPlaneSite"]

log = logging.getLogger("kvroute.gateway")

_MAX_QUEUED = 8  # pipelined requests waiting on one connection before it stops reading
_LINGER_S = 2.0  # after a refusal, the client's remaining bytes are read and dropped this long
_INFERENCE = frozenset(p.encode() for p in INFERENCE_ROUTES)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_RESERIALISE_DROP = frozenset({b"content-length", b"transfer-encoding", b"expect"})
_STATUS_LINES: dict[tuple[str, int], bytes] = {}


def _status_line(version: str, status: int) -> bytes:
    line = _STATUS_LINES.get((version, status))
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _STATUS_LINES[(version, status)] = f"HTTP/{version} {status} {phrase}\r\n".encode()
    return line


class _Date:
    """``Date`` header value, formatted once a second."""

    __slots__ = ("_at", "_value")

    def __init__(self) -> None:
        self._at = -1
        self._value = ""

    def now(self) -> str:
        t = int(time.time())
        if t != self._at:
            self._at, self._value = t, formatdate(t, usegmt=True)
        return self._value


_date = _Date()


class _Refused(Exception):
    """Raised from a parser callback: the request breaks a limit (rule 4)."""

    def __init__(self, status: int, message: str, error_type: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.error_type, self.code = status, message, error_type, code


def _bad_request(message: str) -> _Refused:
    return _Refused(400, message, "invalid_request_error", "bad_http_request")


class _Request:
    """One parsed request (head as raw bytes; decoded only for the inference routes)."""

    __slots__ = (
        "body",
        "chunked",
        "content_length",
        "expect_continue",
        "headers",
        "inference",
        "keep_alive",
        "method",
        "path",
        "size",
        "url",
        "version",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        self.method = b""
        self.version = "1.1"
        self.keep_alive = True
        self.inference = False
        self.path = ""

    def serialise(self) -> bytes:
        """The request as HTTP/1.1 bytes for aiohttp's parser: same line and headers, body whole."""
        parts = [self.method, b" ", self.url, b" HTTP/", self.version.encode(), b"\r\n"]
        for name, value in self.headers:
            if name.lower() not in _RESERIALISE_DROP:
                parts += (name, b": ", value, b"\r\n")
        body = b"".join(self.body)
        if body or self.content_length is not None or self.chunked:
            parts.append(b"Content-Length: %d\r\n" % len(body))
        parts += (b"\r\n", body)
        return b"".join(parts)


class _Raw:
    """Bytes after an upgrade request: aiohttp's, as they came."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class _Final:
    """The last answer on a connection (a refusal); the connection closes after it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _reader(body: bytes) -> Callable[[], Awaitable[bytes]]:
    async def read() -> bytes:
        return body

    return read


class DataPlaneProtocol(asyncio.Protocol):
    """One client connection (module rules 1-7); also the ``Downstream`` of its current request."""

    def __init__(self, plane: DataPlane) -> None:
        self._plane = plane
        self._loop = plane.loop
        limits = plane.rt.config.limits
        self._max_line = limits.max_line_size
        self._max_field = limits.max_field_size
        self._max_headers = limits.max_headers
        self._max_body = limits.max_body_bytes
        self._max_head = limits.max_line_size + limits.max_headers * (limits.max_field_size + 4)
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._peer: str | None = None
        self._cur: _Request | None = None  # being parsed
        self._head_bytes = 0  # bytes received while the current head is incomplete (rule 4)
        self._head_started = 0.0
        self._refusal: _Refused | None = None
        self._queue: deque[_Request | _Raw | _Final] = deque()
        self._queued_bytes = 0  # request bodies waiting in the queue (rule 1)
        self._feeding = False
        self._dead = False  # refused or upgraded: this parser reads no more
        self._upgraded = False
        self._closed = False
        self._reading_paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._aio: RequestHandler | None = None  # aiohttp's handler once handed over (rule 3)
        self._switched = False  # the transport talks to aiohttp's handler directly
        self._handing_over = False  # every request from here on is aiohttp's
        self.last_active = self._loop.time()
        # the request being served and its response
        self._task: asyncio.Task[None] | None = None
        self._req: _Request | None = None
        self._head: bytes | None = None
        self._chunked = False
        self._keep = True
        self._status = 0
        self._ended = False
        self._sent_any = False
        self._body_sent = 0

    # ---- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self.transport = t = cast(asyncio.Transport, transport)
        peer = t.get_extra_info("peername")
        self._peer = peer[0] if isinstance(peer, tuple) and peer else None
        self._plane.conns.add(self)

    def data_received(self, data: bytes) -> None:
        if self._dead:
            if self._upgraded and not self._closed:
                self._queue.append(_Raw(data))  # after an upgrade, until aiohttp has the transport
                self._serve_queue()
            return  # refused: the rest of the connection is not read
        self.last_active = self._loop.time()
        self._feeding = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._upgrade(data[int(exc.args[0]) :])
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or _bad_request(f"malformed HTTP request: {exc}"))
        finally:
            self._feeding = False
        if self._cur is not None and not self._dead and self._head_bytes >= 0:
            self._head_bytes += len(data)
            if self._head_bytes > self._max_head:
                self._refuse(_bad_request("request head too large"))
        self._maybe_switch()

    def eof_received(self) -> bool | None:
        if self._aio is not None and not self._switched:
            self._aio.eof_received()
        return None  # the transport closes: a half-close is a hang-up, as on aiohttp's server

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._plane.conns.discard(self)
        self._queue.clear()
        self._queued_bytes = 0
        if self._aio is not None and not self._switched:
            self._aio.connection_lost(exc)
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # rule 5
        self._wake_writer()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._aio is not None and not self._switched:
            self._aio.pause_writing()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._aio is not None and not self._switched:
            self._aio.resume_writing()
        self._wake_writer()

    # ---- httptools callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._cur = _Request()
        self._head_bytes = 0
        self._head_started = self._loop.time()

    def on_url(self, url: bytes) -> None:
        r = self._cur
        assert r is not None
        r.url += url
        if len(r.url) > self._max_line:
            self._fail(_bad_request(f"request line longer than {self._max_line} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self._cur
        assert r is not None
        if len(name) + len(value) > self._max_field:
            self._fail(_bad_request(f"a header line is longer than {self._max_field} bytes"))
        if len(r.headers) >= self._max_headers:
            self._fail(_bad_request(f"more than {self._max_headers} headers"))
        r.headers.append((name, value))
        low = name.lower()
        if low == b"content-length":
            try:
                r.content_length = int(value)
            except ValueError:
                self._fail(_bad_request("bad Content-Length"))
        elif low == b"transfer-encoding":
            r.chunked = b"chunked" in value.lower()
        elif low == b"expect":
            r.expect_continue = value.strip().lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        r = self._cur
        assert r is not None
        p = self._parser
        self._head_bytes = -1  # the head is whole: body bytes are not counted against it
        r.method = p.get_method()
        r.version = p.get_http_version()
        r.keep_alive = p.should_keep_alive()
        path = r.url.partition(b"?")[0]
        if not self._handing_over and r.method == b"POST" and path in _INFERENCE:
            r.inference = True
            r.path = path.decode()
        else:
            self._handing_over = True  # rule 3: this request and every later one are aiohttp's
        if r.content_length is not None and r.content_length > self._max_body:
            self._fail(self._too_large(f"request body of {r.content_length} bytes exceeds the limit"))
        if r.expect_continue and r.version == "1.1" and self._nothing_ahead() and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        r = self._cur
        assert r is not None
        r.body.append(body)
        r.size += len(body)
        if r.size > self._max_body:
            self._fail(self._too_large("request body exceeds the limit"))

    def on_message_complete(self) -> None:
        r = self._cur
        assert r is not None
        self._cur = None
        self._queue.append(r)
        self._queued_bytes += r.size
        if (
            len(self._queue) >= _MAX_QUEUED or self._queued_bytes > self._max_body
        ) and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._serve_queue()

    # ---- refusals, handover --------------------------------------------------------------------------

    def _too_large(self, what: str) -> _Refused:
        e = PayloadTooLargeError(f"{what} of {self._max_body} bytes")
        return _Refused(e.status, str(e), e.error_type, e.code)

    def _fail(self, refusal: _Refused) -> None:
        self._refusal = refusal
        raise refusal  # httptools stops and raises HttpParserCallbackError (caught in data_received)

    def _refuse(self, r: _Refused) -> None:
        given = None
        if self._cur is not None:
            lower = REQUEST_ID_HEADER.lower().encode()
            given = next((v.decode("latin-1") for k, v in self._cur.headers if k.lower() == lower), None)
        self._dead = True
        self._cur = None
        rid = request_id_for(given)
        self._queue.append(_Final(self._error_bytes(r.status, r.message, r.error_type, r.code, rid, "1.1", False)))
        self._serve_queue()

    def _upgrade(self, rest: bytes) -> None:
        """``Upgrade`` / ``CONNECT``: aiohttp answers it; the bytes after it are aiohttp's too."""
        self._dead = self._upgraded = True
        self._handing_over = True
        for item in self._queue:
            if isinstance(item, _Request):
                item.inference = False
        self._queue.append(_Raw(rest))
        self._serve_queue()

    def _to_aiohttp(self, data: bytes) -> None:
        h = self._aio
        if h is None:
            assert self.transport is not None
            h = self._aio = self._plane.aiohttp_handler()
            h.connection_made(self.transport)
            if self._write_paused:
                h.pause_writing()
        if data:
            h.data_received(data)

    def _maybe_switch(self) -> None:
        """Give the transport to aiohttp's handler once nothing of ours is pending (rule 3)."""
        if self._aio is None or self._switched or self._feeding or self._queue or self._closed:
            return
        if self._cur is not None and not self._dead:
            return  # mid-message: this parser still has to finish it
        t = self.transport
        assert t is not None
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        self._switched = True
        self._plane.conns.discard(self)
        t.set_protocol(self._aio)

    # ---- serving -----------------------------------------------------------------------------------

    def _nothing_ahead(self) -> bool:
        """No earlier request is being served or waiting (an interim answer would not interleave)."""
        return self._task is None and not self._queue

    @property
    def idle(self) -> bool:
        """No request in progress, queued or half-received: shutdown closes it at once."""
        return self._task is None and not self._queue and self._cur is None and not self._switched

    @property
    def serving(self) -> asyncio.Task[None] | None:
        """The task of the request being served, if any."""
        return self._task

    def expired(self, horizon: float) -> bool:
        """For the keep-alive sweep (rule 6): nothing served or queued, and either no byte since
        ``horizon`` or a request head begun before it and still not whole (a head trickled in a
        byte at a time does not keep a connection forever)."""
        if self._task is not None or self._queue or self._switched:
            return False
        if self._cur is not None and self._head_bytes >= 0:
            return self._head_started < horizon
        return self.last_active < horizon

    def _serve_queue(self) -> None:
        while self._queue and self._task is None and not self._closed:
            item = self._queue.popleft()
            if isinstance(item, _Request):
                self._queued_bytes -= item.size
            if isinstance(item, _Final):
                self._queue.clear()
                self._queued_bytes = 0
                if self._aio is None:
                    self._write_and_close(item.data)
                else:  # aiohttp holds the connection's earlier requests: it closes it
                    self._aio.close()
                return
            if isinstance(item, _Raw):
                self._to_aiohttp(item.data)
            elif not item.inference:
                self._to_aiohttp(item.serialise())
            else:
                self._task = self._loop.create_task(self._serve(item))
        if (
            self._reading_paused
            and len(self._queue) < _MAX_QUEUED
            and self._queued_bytes <= self._max_body
            and self.transport is not None
        ):
            self._reading_paused = False
            self.transport.resume_reading()
        self._maybe_switch()

    async def _serve(self, r: _Request) -> None:
        plane = self._plane
        headers: CIMultiDict[str] = CIMultiDict(
            [(k.decode("utf-8", "surrogateescape"), v.decode("utf-8", "surrogateescape")) for k, v in r.headers]
        )
        rid = request_id_for(headers.get(REQUEST_ID_HEADER))
        token = set_request_id(rid)  # every log line of this request names it
        self._req, self._head, self._ended, self._sent_any, self._body_sent = r, None, False, False, 0
        self._keep = r.keep_alive
        status: int | str = "error"
        body = r.body[0] if len(r.body) == 1 else b"".join(r.body)
        try:
            await serve_inference(plane.rt, r.path, headers, self._peer, rid, _reader(body), self)
            status = self._status
        except KvrouteError as exc:
            status = kvroute_error_status(exc)
            if exc.status >= 500:
                log.warning("POST %s -> %s: %s", r.path, exc.code, exc)
            self._answer(status, str(exc) or exc.code, exc.error_type, exc.code, rid)
        except asyncio.CancelledError:
            pass  # the client left (rule 5), or the gateway stops: the lease is already released
        except ConnectionError:
            self._keep = False
        except Exception:
            log.exception("unexpected error serving POST %s", r.path)
            status = 500
            self._answer(500, "internal error", "internal_error", "internal_error", rid)
        finally:
            token.var.reset(token)
            plane.observe(r.path, "POST", status)
            if plane.access_log is not None:
                plane.log_access(self._peer, r, status, self._body_sent, headers)
            self._task = None
            self._req = None
            self._after_response()

    def _after_response(self) -> None:
        self.last_active = self._loop.time()
        if self._closed:
            return
        if not (self._ended and self._keep) or self._plane.closing:
            self.close()
            return
        self._serve_queue()

    def _answer(self, status: int, message: str, error_type: str, code: str, rid: str) -> None:
        """An error of the gateway's own as the request's answer (OpenAI-style JSON)."""
        if self._closed:
            return
        if self._sent_any:  # the status line is out: the body can only be cut short
            self.cut()
            return
        r = self._req
        assert r is not None and self.transport is not None
        self._head = None  # a committed head that never left gives way to the error
        self._keep = self._keep and not self._plane.closing
        self.transport.write(self._error_bytes(status, message, error_type, code, rid, r.version, self._keep))
        self._status, self._ended = status, True

    def _error_bytes(
        self, status: int, message: str, error_type: str, code: str, rid: str | None, version: str, keep: bool
    ) -> bytes:
        body = json.dumps(error_payload(message, error_type, code)).encode()
        head = [
            "Content-Type: application/json; charset=utf-8\r\n",
            f"Content-Length: {len(body)}\r\n",
            f"X-Kvroute-Error: {code}\r\n",
            f"Date: {_date.now()}\r\n",
        ]
        if rid is not None:
            head.append(f"{REQUEST_ID_HEADER}: {rid}\r\n")
        if not keep:
            head.append("Connection: close\r\n")
        elif version == "1.0":
            head.append("Connection: keep-alive\r\n")
        self._body_sent = len(body)
        return b"".join((_status_line(version, status), "".join(head).encode(), b"\r\n", body))

    def _write_and_close(self, data: bytes) -> None:
        """A refusal's answer, then a lingering close: our side ends (FIN) and what the client still
        sends is read and dropped for ``_LINGER_S``, so its unread bytes do not turn our close into a
        reset that destroys the answer before the client reads it (aiohttp lingers the same way)."""
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(data)
        if t.can_write_eof():
            t.write_eof()
            self._loop.call_later(_LINGER_S, self.close)
        else:
            self.close()

    def close(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()

    # ---- Downstream (the current inference request's response) --------------------------------------

    async def begin(self, status: int, headers: Any, content_length: int | None) -> None:
        r = self._req
        assert r is not None
        keep = self._keep and not self._plane.closing
        head = [f"{k}: {v}\r\n" for k, v in headers]
        self._chunked = False
        if content_length is not None:
            head.append(f"Content-Length: {content_length}\r\n")
        elif r.version == "1.1":
            head.append("Transfer-Encoding: chunked\r\n")
            self._chunked = True
        else:
            keep = False  # HTTP/1.0: the body ends with the connection
        if not keep:
            head.append("Connection: close\r\n")
        elif r.version == "1.0":
            head.append("Connection: keep-alive\r\n")
        self._keep = keep
        self._status = status
        # no name or value here holds a line break: a replica's were parsed by httptools, ours are
        # sanitised (request ids) or checked (handlers._decision_headers)
        self._head = b"".join(
            (_status_line(r.version, status), "".join(head).encode("utf-8", "surrogateescape"), b"\r\n")
        )

    async def write(self, data: bytes) -> None:
        t = self.transport
        if self._closed or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if not data:
            return  # an empty chunk would end a chunked body
        self._body_sent += len(data)
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head is not None:
            data = self._head + data
            self._head = None
        self._sent_any = True
        t.write(data)
        if self._write_paused:
            await self._wait_writable()

    async def end(self, last: bytes) -> None:
        t = self.transport
        if self._closed or t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self._body_sent += len(last)
        parts: list[bytes] = []
        if self._head is not None:
            parts.append(self._head)
            self._head = None
        if self._chunked:
            if last:
                parts.append(b"%x\r\n%b\r\n" % (len(last), last))
            parts.append(b"0\r\n\r\n")
        else:
            parts.append(last)
        self._sent_any = True
        t.write(b"".join(parts))
        self._ended = True

    def cut(self) -> None:
        self._keep = False
        self.close()

    async def _wait_writable(self) -> None:
        while self._write_paused and not self._closed:
            fut = self._drain = self._loop.create_future()
            await fut
        if self._closed:
            raise ConnectionResetError("the client closed the connection")

    def _wake_writer(self) -> None:
        fut = self._drain
        if fut is not None and not fut.done():
            fut.set_result(None)
        self._drain = None


class DataPlane:
    """The listener's protocol factory and the registry of its connections (for keep-alive and
    shutdown). ``aiohttp_server`` is the ``web.Server`` of the gateway's ``AppRunner``: the
    handler factory requests are handed to (rule 3)."""

    def __init__(
        self,
        rt: GatewayRuntime,
        responses: GatewayMiddleware,
        aiohttp_server: web.Server,
        *,
        access_log: logging.Logger | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.rt = rt
        self.observe = responses.observe
        self.access_log = access_log
        self.keepalive_s = rt.config.downstream.keepalive_s
        self.conns: set[DataPlaneProtocol] = set()
        self.closing = False
        self._aio_server = aiohttp_server
        self._sweeper = self.loop.create_task(self._sweep(), name="kvroute-keepalive")

    def __call__(self) -> DataPlaneProtocol:
        return DataPlaneProtocol(self)

    def aiohttp_handler(self) -> RequestHandler:
        return self._aio_server()

    def log_access(
        self, peer: str | None, r: _Request, status: int | str, size: int, headers: CIMultiDict[str]
    ) -> None:
        """One line per request, in aiohttp's default access-log format."""
        assert self.access_log is not None
        self.access_log.info(
            '%s [%s] "POST %s HTTP/%s" %s %d "%s" "%s"',
            peer or "-",
            time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime()),
            r.url.decode("latin-1"),
            r.version,
            status,
            size,
            headers.get("Referer", "-"),
            headers.get("User-Agent", "-"),
        )

    async def _sweep(self) -> None:
        period = max(0.05, min(5.0, self.keepalive_s / 4))
        while True:
            await asyncio.sleep(period)
            horizon = self.loop.time() - self.keepalive_s
            for conn in [c for c in self.conns if c.expired(horizon)]:
                conn.close()

    def stop_accepting(self) -> None:
        """Shutdown has begun: idle connections close now, busy ones after their answer (rule 6)."""
        self.closing = True
        for conn in [c for c in self.conns if c.idle]:
            conn.close()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close every connection still open and stop the sweep. Requests still being served are
        cancelled; this waits (bounded) until they have released their load, as aiohttp's server
        waits for its handlers, so the store and the upstream client outlive them."""
        self.stop_accepting()
        tasks = [t for c in self.conns if (t := c.serving) is not None]
        for conn in list(self.conns):
            conn.close()  # connection_lost cancels its request
        self._sweeper.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        try:
            await self._sweeper
        except asyncio.CancelledError:
            pass


class DataPlaneSite(web.BaseSite):
    """A TCP site of the gateway's ``AppRunner`` whose connections start on the data plane."""

    __slots__ = ("_host", "_plane", "_port", "_reuse_address")

    def __init__(
        self,
        runner: web.BaseRunner,
        plane: DataPlane,
        host: str,
        port: int,
        *,
        ssl_context: Any = None,
        backlog: int = 128,
        reuse_address: bool = True,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self._plane = plane
        self._host = host
        self._port = port
        self._reuse_address = reuse_address

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await self._plane.loop.create_server(
            self._plane,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )

    async def stop(self) -> None:
        await super().stop()
        self._plane.stop_accepting()
