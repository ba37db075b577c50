"""The network edge towards replicas: ``ReplicaClient`` seam, its aiohttp implementation, header
hygiene, and the response "sniffer" that learns token counts without touching the bytes.

Rules:
  1. Bodies are forwarded byte for byte: the request body is never re-serialised, the response is
     relayed chunk by chunk as it arrives (``iter_any``), never decompressed (``auto_decompress``
     off) and never buffered whole.
  2. Hop-by-hop headers (RFC 9110 §7.6.1: Connection, Keep-Alive, Proxy-*, TE, Trailer,
     Transfer-Encoding, Upgrade, and every header named in Connection) are dropped both ways;
     Content-Length and Host are recomputed by aiohttp.
  3. aiohttp's exceptions never leave this module: :func:`map_client_errors` maps them to
     ``router.errors`` (the single mapping boundary, STYLE §5).
  4. One ``ClientSession`` per application, bounded connection pool. Closing an unfinished
     upstream response closes its connection, which makes SGLang (and the emulator) abort the
     request: that is how a client's disconnect reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import aiohttp
import orjson
from multidict import CIMultiDict

from router.config import TimeoutsConfig
from router.errors import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeoutError,
)

__all__ = [
    "HOP_BY_HOP",
    "AiohttpReplicaClient",
    "ConnectFailure",
    "ReplicaClient",
    "UpstreamResponse",
    "Usage",
    "UsageSniffer",
    "filter_headers",
    "filter_request_headers",
    "filter_response_headers",
    "is_connect_failure",
    "map_client_errors",
    "read_limited",
    "request_drop_set",
    "response_drop_set",
    "usage_from_json",
]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# recomputed or owned by the gateway's own HTTP stack
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}


def _connection_tokens(headers: Iterable[tuple[str, str]]) -> set[str]:
    named: set[str] = set()
    for k, v in headers:
        if k.lower() == "connection":
            named.update(t.strip().lower() for t in v.split(",") if t.strip())
    return named


def _filter(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    # one pass, one lower() per header: this runs twice per request
    out: list[tuple[str, str]] = []
    named: set[str] | None = None
    for k, v in headers:
        low = k.lower()
        if low == "connection":
            named = named or set()
            named.update(t.strip().lower() for t in v.split(",") if t.strip())
        if low not in drop:
            out.append((k, v))
    if named:
        out = [(k, v) for k, v in out if k.lower() not in named]
    return out


def filter_request_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Client -> replica: end-to-end headers only (Authorization passes: the replica may check it)."""
    return _filter(headers, _REQUEST_DROP)


def filter_response_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """Replica -> client: end-to-end headers only."""
    return _filter(headers, _RESPONSE_DROP)


def request_drop_set(extra: Iterable[str] = ()) -> frozenset[str]:
    """The (lower-case) names ``filter_request_headers`` drops, plus ``extra`` (lower-case)."""
    return _REQUEST_DROP | frozenset(extra)


def response_drop_set(extra: Iterable[str] = ()) -> frozenset[str]:
    """The (lower-case) names ``filter_response_headers`` drops, plus ``extra`` (lower-case)."""
    return _RESPONSE_DROP | frozenset(extra)


def filter_headers(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """Drop every header named in ``drop`` (lower-case) or in a ``Connection`` header, one pass
    (``filter_request_headers`` is ``filter_headers(h, request_drop_set())``)."""
    return _filter(headers, drop)


# ---- errors ---------------------------------------------------------------------------------------


class ConnectFailure(ConnectionError):
    """The cause of an ``UpstreamConnectError`` raised because no new connection to the replica could
    be made (refused, unreachable, connect timeout) by a client other than aiohttp
    (``upstream_raw.py``): :func:`is_connect_failure` is true for it, as for aiohttp's
    ``ClientConnectorError``."""


def _mapped(replica_id: str, exc: BaseException) -> UpstreamError | None:
    if isinstance(exc, UpstreamError) or not isinstance(exc, Exception):
        return None  # ours already, or CancelledError / KeyboardInterrupt: never mapped
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        return UpstreamTimeoutError(f"replica {replica_id}: timed out")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return UpstreamBrokenError(f"replica {replica_id}: response broke off: {exc}")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamConnectError(f"replica {replica_id}: server disconnected")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamConnectError(f"replica {replica_id}: cannot connect: {exc.os_error}")
    if isinstance(exc, (aiohttp.ClientError, OSError)):
        return UpstreamConnectError(f"replica {replica_id}: {type(exc).__name__}: {exc}")
    return None


class _ClientErrorMap:
    """The context manager behind :func:`map_client_errors` (a class: it runs once per chunk)."""

    __slots__ = ("_rid",)

    def __init__(self, replica_id: str) -> None:
        self._rid = replica_id

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> Literal[False]:
        if exc is None:
            return False
        mapped = _mapped(self._rid, exc)
        if mapped is None:
            return False
        raise mapped from exc


def map_client_errors(replica_id: str) -> AbstractContextManager[None]:
    """Re-raise aiohttp/socket errors as ``router.errors.Upstream*Error`` (never CancelledError)."""
    return _ClientErrorMap(replica_id)


def is_connect_failure(exc: BaseException) -> bool:
    """The replica could not be reached at all (refused, unreachable, connect timeout) - as opposed
    to a reused keep-alive connection the server closed at the wrong moment, which says nothing
    about the replica's health. Only the former counts towards passive ejection."""
    return isinstance(exc, UpstreamConnectError) and isinstance(
        exc.__cause__, (aiohttp.ClientConnectorError, ConnectFailure)
    )


# ---- the seam ---------------------------------------------------------------------------------------


async def read_limited(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """At most ``limit`` bytes of a body, draining the rest (so the connection can be reused).
    An error body that breaks off is still an error: what arrived is kept."""
    out = bytearray()
    try:
        async for chunk in chunks:
            if len(out) < limit:
                out += chunk[: limit - len(out)]
    except UpstreamError:
        pass
    return bytes(out)


class UpstreamResponse(Protocol):
    status: int

    @property
    def headers(self) -> Sequence[tuple[str, str]]: ...

    @property
    def content_type(self) -> str: ...

    @property
    def content_length(self) -> int | None: ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises ``UpstreamError`` subclasses (idle timeout, break)."""
        ...

    def at_eof(self) -> bool:
        """``chunks()`` has handed out the whole body (the next one ends the iteration): the caller
        may send the chunk it holds together with the end of its own response."""
        ...

    async def read(self, limit: int) -> bytes:
        """Up to ``limit`` bytes of the body (error bodies); the rest is discarded."""
        ...

    def release(self) -> None:
        """The body was fully read: the connection may be reused."""
        ...

    def abort(self) -> None:
        """Close the connection now (the engine sees the disconnect and aborts the request)."""
        ...


class ReplicaClient(Protocol):
    async def send(
        self, replica_id: str, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send a request; returns once the status line and headers arrived (first-byte timeout)."""
        ...

    async def fetch(
        self, replica_id: str, url: str, *, accept: str | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """A small GET (health, metrics, models): status and whole body."""
        ...

    async def close(self) -> None: ...


# ---- aiohttp implementation -------------------------------------------------------------------------


class _AiohttpUpstream:
    __slots__ = ("_first_s", "_idle_s", "_resp", "_rid", "status")

    def __init__(self, resp: aiohttp.ClientResponse, replica_id: str, idle_s: float, first_s: float) -> None:
        self._resp = resp
        self._rid = replica_id
        self._idle_s = idle_s
        self._first_s = first_s  # the first body chunk may wait for a whole prefill
        self.status = resp.status

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        return list(self._resp.headers.items())

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("Content-Type", "")

    @property
    def content_length(self) -> int | None:
        return self._resp.content_length

    async def chunks(self) -> AsyncIterator[bytes]:
        # ``iter_any`` chunking (all that is buffered, at once), but bytes already buffered are
        # taken without arming a timer: a small response usually arrives with its headers
        content = self._resp.content
        limit = self._first_s
        while True:
            with map_client_errors(self._rid):
                chunk = content.read_nowait()
                if not chunk:
                    if content.at_eof():
                        return
                    async with asyncio.timeout(limit):
                        chunk = await content.readany()
                    if not chunk:
                        return
            limit = self._idle_s
            yield chunk

    async def read(self, limit: int) -> bytes:
        return await read_limited(self.chunks(), limit)

    def at_eof(self) -> bool:
        return self._resp.content.at_eof()

    def release(self) -> None:
        self._resp.release()

    def abort(self) -> None:
        self._resp.close()


class AiohttpReplicaClient:
    """``ReplicaClient`` over one ``aiohttp.ClientSession`` (create inside a running loop)."""

    def __init__(
        self,
        timeouts: TimeoutsConfig,
        *,
        max_connections: int = 1024,
        max_connections_per_replica: int = 0,
        trace_configs: Sequence[aiohttp.TraceConfig] = (),
    ) -> None:
        self._timeouts = timeouts
        connector = aiohttp.TCPConnector(
            limit=max_connections, limit_per_host=max_connections_per_replica, enable_cleanup_closed=False
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # a proxy keeps no cookies: a replica's Set-Cookie is relayed to its client, never
            # stored and replayed to other clients (and no per-request jar filtering)
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,  # relay Content-Encoding'd bytes as they are
            timeout=aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=timeouts.connect_s, sock_read=None
            ),
            trace_configs=list(trace_configs) or None,
            skip_auto_headers=("User-Agent",),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def send(
        self, replica_id: str, method: str, url: str, headers: Sequence[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        hdrs: CIMultiDict[str] = CIMultiDict(headers)
        # add nothing the client did not send (aiohttp would add Accept-Encoding and, for a bytes
        # body, Content-Type: application/octet-stream)
        skip = tuple(h for h in ("Accept-Encoding", "Content-Type") if h not in hdrs)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with map_client_errors(replica_id):
            async with asyncio.timeout(self._timeouts.first_byte_s):
                resp = await self._session.request(
                    method,
                    url,
                    data=body,
                    headers=hdrs,
                    allow_redirects=False,
                    skip_auto_headers=skip,
                )
        # headers may come before the first body byte (SSE): the first chunk gets what is left of
        # first_byte_s (at least connect_s), later chunks idle_read_s each
        left = max(self._timeouts.connect_s, self._timeouts.first_byte_s - (loop.time() - started))
        return _AiohttpUpstream(resp, replica_id, self._timeouts.idle_read_s, left)

    async def fetch(
        self, replica_id: str, url: str, *, accept: str | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        headers = {"Accept": accept} if accept else {}
        with map_client_errors(replica_id):
            async with asyncio.timeout(timeout_s or self._timeouts.probe_s):
                async with self._session.get(url, headers=headers, allow_redirects=False) as resp:
                    body = await resp.read()
                    if resp.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                        body = b""  # probes never ask for compression; refuse to guess
                    return resp.status, body

    async def close(self) -> None:
        await self._session.close()


# ---- learning from responses --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _from_obj(obj: Mapping[str, Any]) -> Usage | None:
    usage = obj.get("usage")
    if isinstance(usage, Mapping):
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        u = Usage(_int(usage.get("prompt_tokens")), cached, _int(usage.get("completion_tokens")))
        if u.prompt_tokens is not None:
            return u
    meta = obj.get("meta_info")
    if isinstance(meta, Mapping):
        u = Usage(
            _int(meta.get("prompt_tokens")),
            _int(meta.get("cached_tokens")),
            _int(meta.get("completion_tokens")),
        )
        if u.prompt_tokens is not None:
            return u
    return None


def usage_from_json(data: Any) -> Usage | None:
    """Token counts from an OpenAI (``usage``) or native (``meta_info``) response object.

    A list (batch ``/generate``) sums its items. ``cached_tokens`` is ``None`` when the engine did
    not report it (``--enable-cache-report`` off).
    """
    if isinstance(data, Mapping):
        return _from_obj(data)
    if isinstance(data, list):
        parts = [u for item in data if isinstance(item, Mapping) and (u := _from_obj(item)) is not None]
        if not parts:
            return None

        def total(vals: list[int | None]) -> int | None:
            return None if any(v is None for v in vals) else sum(v for v in vals if v is not None)

        return Usage(
            total([p.prompt_tokens for p in parts]),
            total([p.cached_tokens for p in parts]),
            total([p.completion_tokens for p in parts]),
        )
    return None


class UsageSniffer:
    """Watches relayed bytes and extracts the last token counts; never alters or delays them.

    SSE: an incremental line splitter; a ``data:`` line is a candidate only if it mentions
    ``"usage"`` or ``"meta_info"`` *and* ``"prompt_tokens"``. Only the last candidate is kept (raw) and
    parsed once at the end, so cumulative ``/generate`` streams cost no per-chunk JSON parsing.
    JSON: the body is accumulated up to ``max_json_bytes`` and parsed at the end.
    """

    __slots__ = ("_buf", "_last", "_max", "_mode", "_overflow", "events")

    def __init__(
        self,
        content_type: str,
        *,
        max_json_bytes: int = 8 * 1024 * 1024,
        max_line_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        ct = content_type.split(";", 1)[0].strip().lower()
        self._mode = "sse" if ct == "text/event-stream" else "json" if ct.endswith("json") else "none"
        self._buf = bytearray()
        self._last: bytes | None = None
        self._max = max_json_bytes if self._mode == "json" else max_line_bytes
        self._overflow = False
        self.events = 0  # complete SSE data lines seen

    @property
    def is_sse(self) -> bool:
        return self._mode == "sse"

    def feed(self, chunk: bytes) -> None:
        if self._mode == "json":
            if not self._overflow:
                if len(self._buf) + len(chunk) > self._max:
                    self._overflow = True
                    self._buf.clear()
                else:
                    self._buf += chunk
            return
        if self._mode != "sse":
            return
        if not self._buf and not self._overflow and chunk.endswith(b"\n"):
            # the usual case: whole lines (events arrive whole). A raw newline cannot occur inside a
            # JSON string, so "\ndata:" is exactly a line start: count in C, split only the chunk
            # that holds a usage candidate (one per stream)
            n = chunk.count(b"\ndata:") + chunk.startswith(b"data:")
            self.events += n
            if n and b'"prompt_tokens"' in chunk:
                for line in chunk.split(b"\n"):
                    if line.startswith(b"data:"):
                        self._candidate(line)
            return
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                rest = chunk[start:]
                if self._overflow or len(self._buf) + len(rest) > self._max:
                    self._overflow = True  # skip this over-long line entirely
                    self._buf.clear()
                else:
                    self._buf += rest
                return
            if self._overflow:
                self._overflow = False
            else:
                if self._buf:
                    self._buf += chunk[start:nl]
                    self._line(bytes(self._buf))
                    self._buf.clear()
                else:
                    self._line(chunk[start:nl])
            start = nl + 1

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        self.events += 1
        self._candidate(line)

    def _candidate(self, line: bytes) -> None:
        if b'"prompt_tokens"' in line and (b'"usage"' in line or b'"meta_info"' in line):
            self._last = line

    def result(self) -> Usage | None:
        if self._mode == "json":
            if self._overflow or not self._buf:
                return None
            return usage_from_json(_loads(self._buf))
        if self._last is None:
            return None
        return usage_from_json(_loads(self._last[5:].strip()))


def _loads(raw: bytes | bytearray) -> Any:
    """orjson (several times faster than json on whole response bodies), json for what orjson
    refuses (integers over 64 bits, NaN); ``None`` if neither parses it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
