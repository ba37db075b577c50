"""The network edge towards replicas: the ``ReplicaClient`` seam, header hygiene, the upstream tracer
seam, and the response "sniffer" that learns token counts without touching the bytes. The client
itself is ``upstream.py``.

Rules:
  1. Bodies are forwarded byte for byte: the request body is never re-serialised (a field the engine
     needs may be spliced in first, :func:`with_first_field`), the response is relayed chunk by chunk
     as it arrives, never decompressed and never buffered whole.
  2. Hop-by-hop headers (RFC 9110 §7.6.1: Connection, Keep-Alive, Proxy-*, TE, Trailer,
     Transfer-Encoding, Upgrade, and every header named in Connection) are dropped both ways;
     Content-Length and Host are recomputed by the HTTP stack that sends them.
  3. A client raises only ``router.errors.Upstream*Error``; a connect failure (the replica could not
     be reached at all) carries a :class:`ConnectFailure` as its cause (:func:`is_connect_failure`).
  4. Closing an unfinished upstream response closes its connection, which makes SGLang (and the
     emulator) abort the request: that is how a client's disconnect reaches the engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from router.errors import UpstreamConnectError, UpstreamError

__all__ = [
    "DP_RANK_FIELD",
    "DP_RANK_FIELDS",
    "DP_RANK_HEADER",
    "HOP_BY_HOP",
    "ConnectFailure",
    "ReplicaClient",
    "UpstreamResponse",
    "UpstreamSpan",
    "UpstreamTracer",
    "Usage",
    "UsageSniffer",
    "filter_headers",
    "filter_request_headers",
    "filter_response_headers",
    "is_connect_failure",
    "read_limited",
    "request_drop_set",
    "response_drop_set",
    "usage_from_json",
    "with_first_field",
]

DP_RANK_HEADER = "X-Data-Parallel-Rank"  # SGLang's routed_dp_rank on its OpenAI and Anthropic routes
DP_RANK_FIELD = "routed_dp_rank"  # and in the body, which native /generate reads alone
DP_RANK_FIELDS = (b'"routed_dp_rank"', b'"data_parallel_rank"')  # a body naming its rank (or the old alias)
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
    be made (refused, unreachable, connect timeout)."""


def is_connect_failure(exc: BaseException) -> bool:
    """The replica could not be reached at all (refused, unreachable, connect timeout) - as opposed
    to a reused keep-alive connection the server closed at the wrong moment, which says nothing
    about the replica's health. Only the former counts towards passive ejection."""
    return isinstance(exc, UpstreamConnectError) and isinstance(exc.__cause__, ConnectFailure)


# ---- the seams --------------------------------------------------------------------------------------


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
        """Close the connection now (the engine sees the disconnect and aborts the request); a no-op
        once released."""
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


class UpstreamSpan(Protocol):
    """A client span around one upstream request (``router.observability.tracing``)."""

    @property
    def headers(self) -> Sequence[tuple[str, str]]:
        """What the upstream request carries so the replica continues the trace (``traceparent``)."""
        ...

    def end(self, status: int) -> None:
        """The status line arrived (the span covers connect + headers; the body is the parent's)."""
        ...

    def fail(self, exc: BaseException) -> None: ...


class UpstreamTracer(Protocol):
    def start(self, method: str, url: str) -> UpstreamSpan | None:
        """A span for one upstream request, ``None`` outside a traced request (probes, scrapes)."""
        ...


# ---- learning from responses --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def anthropic_usage(usage: Mapping[str, Any], output_tokens: int | None) -> Usage | None:
    """Anthropic's usage (Messages API): ``input_tokens`` is the part of the prompt not read from the
    cache, ``cache_read_input_tokens`` the part that was (SGLang leaves it out when 0)."""
    uncached = _int(usage.get("input_tokens"))
    if uncached is None:
        return None
    cached = _int(usage.get("cache_read_input_tokens")) or 0
    created = _int(usage.get("cache_creation_input_tokens")) or 0
    return Usage(uncached + created + cached, cached, output_tokens)


def _from_obj(obj: Mapping[str, Any]) -> Usage | None:
    usage = obj.get("usage")
    if isinstance(usage, Mapping) and "input_tokens" in usage:
        details = usage.get("input_tokens_details")
        if isinstance(details, Mapping):  # OpenAI's Responses API: input_tokens is the whole prompt
            return Usage(_int(usage.get("input_tokens")), _int(details.get("cached_tokens")),
                         _int(usage.get("output_tokens")))  # fmt: skip
        return anthropic_usage(usage, _int(usage.get("output_tokens")))
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


def usage_from_json(data: Any, samples_per_prompt: int = 1) -> Usage | None:
    """Token counts from an OpenAI (``usage``) or native (``meta_info``) response object.

    A list (batch ``/generate``, or ``sampling_params.n`` > 1) sums the completion tokens of its
    items and the prompt and cached tokens of one item per prompt: SGLang lists a prompt's
    ``samples_per_prompt`` sequences together, each with the whole prompt's counts.
    ``cached_tokens`` is ``None`` when the engine did not report it (``--enable-cache-report`` off).
    """
    if isinstance(data, Mapping):
        return _from_obj(data)
    if isinstance(data, list):
        items = [_from_obj(item) if isinstance(item, Mapping) else None for item in data]
        parts = [u for u in items if u is not None]
        if not parts:
            return None
        firsts = [u for u in items[:: max(1, samples_per_prompt)] if u is not None]

        def total(vals: list[int | None]) -> int | None:
            return None if any(v is None for v in vals) else sum(v for v in vals if v is not None)

        return Usage(
            total([p.prompt_tokens for p in firsts]),
            total([p.cached_tokens for p in firsts]),
            total([p.completion_tokens for p in parts]),
        )
    return None


class UsageSniffer:
    """Watches relayed bytes and extracts the last token counts; never alters or delays them.

    SSE: an incremental line splitter; a ``data:`` line is a candidate only if it mentions
    ``"usage"`` or ``"meta_info"`` *and* ``"prompt_tokens"``. Only the last candidate is kept (raw) and
    parsed once at the end, so cumulative ``/generate`` streams cost no per-chunk JSON parsing.
    Anthropic's Messages API streams its usage in two parts: the input in ``message_start``, the
    output in ``message_delta``; OpenAI's Responses API in its last event (``response.completed``
    or ``response.incomplete``), the whole response with its usage.
    JSON: the body is accumulated up to ``max_json_bytes`` and parsed at the end.

    ``errored``: the engine reported a failure inside a 200 stream -- an ``{"error": ...}`` event
    (Anthropic's ``{"type": "error", ...}``, the Responses API's ``response.failed``), or a
    ``/generate`` chunk finished with ``abort`` -- as SGLang does for a prompt its scheduler refuses
    (then a usage chunk counts the one-token stand-in it ran: nothing to learn from).
    """

    __slots__ = ("_buf", "_doc", "_last", "_max", "_mode", "_overflow", "_start", "errored", "events")

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
        self._doc: Any = None  # the JSON body, parsed once (``document``)
        self._last: bytes | None = None
        self._start: bytes | None = None  # Anthropic's message_start
        self._max = max_json_bytes if self._mode == "json" else max_line_bytes
        self._overflow = False
        self.errored = False
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
            if n and (b'_tokens"' in chunk or b'"error"' in chunk):
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
        data = line[5:].lstrip()
        if data.startswith((b'{"error"', b'{"type":"error"', b'{"type":"response.failed"')):
            self.errored = True
        elif (b'"prompt_tokens"' in line and (b'"usage"' in line or b'"meta_info"' in line)) or data.startswith(
            (b'{"type":"response.completed"', b'{"type":"response.incomplete"')  # the Responses API's last
        ):
            self._last = line
        elif data.startswith(b'{"type":"message_start"') and b'"input_tokens"' in line:
            self._start = line
        elif data.startswith(b'{"type":"message_delta"') and b'"output_tokens"' in line:
            self._last = line

    def result(self, samples_per_prompt: Callable[[], int] = lambda: 1) -> Usage | None:
        """``samples_per_prompt``: asked only of a JSON list (``usage_from_json``), the rare case
        that needs the request's ``n``."""
        if self._mode == "json":
            data = self.document()
            if data is None:
                return None
            return usage_from_json(data, samples_per_prompt() if isinstance(data, list) else 1)
        if self.errored:
            return None
        if self._start is not None:
            return self._anthropic_result(self._start, self._last)
        if self._last is None:
            return None
        obj = _loads(self._last[5:].strip())
        if isinstance(obj, dict) and isinstance(obj.get("response"), Mapping):
            obj = obj["response"]  # the Responses API's last event carries the whole response
        meta = obj.get("meta_info") if isinstance(obj, dict) else None
        finish = meta.get("finish_reason") if isinstance(meta, dict) else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            self.errored = True
            return None
        return usage_from_json(obj)


    def document(self) -> Any:
        """The JSON body as parsed, once it is complete; ``None`` for a stream, an over-long or
        unparsable body."""
        if self._mode != "json" or self._overflow or not self._buf:
            return None
        if self._doc is None:
            self._doc = _loads(self._buf)
        return self._doc

    @staticmethod
    def _anthropic_result(start: bytes, delta: bytes | None) -> Usage | None:
        message = _loads(start[5:].strip())
        message = message.get("message") if isinstance(message, dict) else None
        usage = message.get("usage") if isinstance(message, dict) else None
        if not isinstance(usage, Mapping):
            return None
        out = _loads(delta[5:].strip()) if delta is not None else None
        out_usage = out.get("usage") if isinstance(out, dict) else None
        return anthropic_usage(usage, _int(out_usage.get("output_tokens")) if isinstance(out_usage, Mapping) else None)


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


def with_first_field(body: bytes, name: str, value: object, unless: Sequence[bytes]) -> bytes:
    """``body`` (a JSON object) with ``"name": value`` added as its first member. Unchanged when the
    body holds any of ``unless`` (quoted keys: the client's own wins, or the engine refuses the
    pair; a match inside a string only costs the addition) or is not an object. One copy of the
    body, no parse."""
    if any(u in body for u in unless):
        return body
    i = 0
    n = len(body)
    while i < n and body[i] in b" \t\r\n":
        i += 1
    if i >= n or body[i] != 0x7B:  # "{"
        return body
    j = i + 1
    while j < n and body[j] in b" \t\r\n":
        j += 1
    sep = b"" if j < n and body[j] == 0x7D else b","  # "{}"
    return body[: i + 1] + orjson.dumps(name) + b":" + orjson.dumps(value) + sep + body[i + 1 :]
