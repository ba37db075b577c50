"""Cross-cutting HTTP concerns of the gateway: request ids, error mapping, body limits, response
counting - in one aiohttp middleware (:class:`GatewayMiddleware`): each middleware layer costs a
coroutine and a handler wrapper per request, and these concerns run on every request.

Rules:
  1. Every response (success, error, stream) carries ``X-Request-Id``: the client's own if it is
     a sane token (≤ 128 chars of ``[A-Za-z0-9._:-]``), else a fresh unique id of 32 hex chars (a
     random per-process prefix + a counter). It is also set in the logging context so every log
     line of the request names it. The middleware adds it to every response a handler returns
     unsent; a handler that streams adds it before it sends its headers (``handlers.py``).
  2. ``router.errors`` and aiohttp's HTTP exceptions become OpenAI-style JSON
     (``router.errors.error_body``) with the matching status and an ``X-Kvroute-Error`` header
     naming the code. Nothing else is caught here: an unexpected exception is a bug and gets a JSON
     500 without internals.
  3. Body size: a declared ``Content-Length`` over the limit is refused with 413 before a byte of
     the body is read; a chunked body is counted while read and refused as soon as it crosses it.
  4. Header size is enforced by aiohttp's parser (``limits.max_field_size``/``max_line_size``/
     ``max_headers``); it answers 400 and closes the connection. The parser fails before any
     middleware runs: ``serve.py``'s request handler renders that answer as the same JSON error.
  5. Extension points instead of more middleware layers: ``add_observer`` (called once per request
     with its route, method and final status: the metrics counter) and ``add_outer`` (one
     aiohttp-style middleware run around this one: tracing's server span).
  6. No secrets in logs: ``router.observability.logging`` redacts credentials; this module never
     logs header values.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from http import HTTPStatus

from aiohttp import web

from router.errors import KvrouteError, PayloadTooLargeError, UpstreamStatusError, error_body
from router.observability.logging import set_request_id

__all__ = [
    "REQUEST_ID_HEADER",
    "REQUEST_ID_KEY",
    "GatewayMiddleware",
    "ResponseObserver",
    "error_response",
    "kvroute_error_status",
    "parse_error_body",
    "read_body_limited",
    "request_id_for",
    "route_label",
]

log = logging.getLogger("kvroute.gateway")

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("kvroute_request_id", str)
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
ResponseObserver = Callable[[str, str, "int | str"], None]
"""Called once per request with its route (the matched resource's template, ``"unmatched"``, never
the raw path), method and final status (``"error"``: an exception escaped)."""


def route_label(request: web.Request) -> str:
    """The route a response is counted under: the matched resource's template, never the raw path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class _RequestIds:
    """Unique request ids, 32 hex chars: 64 random bits per process (new after a fork) + a counter
    (uuid4 would read /dev/urandom on every request)."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self) -> None:
        self._prefix = ""
        self._counter = itertools.count()
        self.reseed()

    def reseed(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


_ids = _RequestIds()
os.register_at_fork(after_in_child=_ids.reseed)


def request_id_for(given: str | None) -> str:
    """The request's id: the client's ``X-Request-Id`` if it is a sane token, else a fresh one."""
    return given if given and _SANE_ID.match(given) else _ids.next()


_HTTP_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    401: ("authentication_error", "unauthorized"),
    403: ("permission_error", "forbidden"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "payload_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "headers_too_large"),
}


def error_response(
    status: int, message: str, error_type: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    hdrs = {"X-Kvroute-Error": code}
    if headers:
        hdrs.update(headers)
    return web.json_response(error_body(message, error_type, code), status=status, headers=hdrs)


def parse_error_body(status: int, message: str | None) -> tuple[dict[str, object], str]:
    """The JSON body and code for a request aiohttp's parser refused (rule 4)."""
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Error"
    if status < 500:
        code = "bad_http_request"
        return error_body(message or reason, "invalid_request_error", code), code
    return error_body(reason, "internal_error", "internal_error"), "internal_error"


def kvroute_error_status(exc: KvrouteError) -> int:
    """The status a ``KvrouteError`` answers with (a replica's own 5xx becomes 502)."""
    return 502 if isinstance(exc, UpstreamStatusError) else exc.status


def _from_kvroute(exc: KvrouteError) -> web.Response:
    return error_response(kvroute_error_status(exc), str(exc) or exc.code, exc.error_type, exc.code)


def _from_http(request: web.Request, exc: web.HTTPException) -> web.Response:
    etype, code = _HTTP_TYPES.get(
        exc.status,
        ("invalid_request_error" if exc.status < 500 else "server_error", f"http_{exc.status}"),
    )
    message = exc.reason if exc.status != 404 else f"unknown route: {request.method} {request.path}"
    if exc.status == 405:
        message = f"method {request.method} not allowed on {request.path}"
    extra = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return error_response(exc.status, message, etype, code, extra)


class GatewayMiddleware:
    """Request id + error mapping + response observers as one aiohttp middleware (rules 1, 2, 5)."""

    __middleware_version__ = 1  # what @web.middleware marks: new-style (request, handler)

    def __init__(self, observers: Sequence[ResponseObserver] = ()) -> None:
        self.observers: tuple[ResponseObserver, ...] = tuple(observers)
        self._outer: Middleware | None = None

    def add_observer(self, observer: ResponseObserver) -> None:
        self.observers = (*self.observers, observer)

    def add_outer(self, middleware: Middleware) -> None:
        """Run ``middleware`` around this one (before the app starts; one at most)."""
        if self._outer is not None:
            raise RuntimeError("GatewayMiddleware: an outer middleware is already set")
        self._outer = middleware

    def _observe(self, request: web.Request, status: int | str) -> None:
        route = route_label(request)
        for obs in self.observers:
            obs(route, request.method, status)

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        outer = self._outer
        if outer is None:
            return await self._handle(request, handler)
        return await outer(request, lambda r: self._handle(r, handler))

    async def _handle(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        rid = request_id_for(request.headers.get(REQUEST_ID_HEADER))
        request[REQUEST_ID_KEY] = rid
        token = set_request_id(rid)  # every log line of this request names it
        try:
            try:
                resp = await handler(request)
            except KvrouteError as exc:
                if exc.status >= 500:
                    log.warning("%s %s -> %s: %s", request.method, request.path, exc.code, exc)
                resp = _from_kvroute(exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    if self.observers:
                        self._observe(request, exc.status)
                    raise  # redirects and the like are not errors
                resp = _from_http(request, exc)
            except BaseException:
                if self.observers:
                    self._observe(request, "error")
                raise
            if not resp.prepared and REQUEST_ID_HEADER not in resp.headers:
                resp.headers[REQUEST_ID_HEADER] = rid
            if self.observers:
                self._observe(request, resp.status)
            return resp
        finally:
            token.var.reset(token)


async def read_body_limited(request: web.Request, limit: int) -> bytes:
    """The whole request body, refusing (413) anything over ``limit`` bytes as early as possible."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise PayloadTooLargeError(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    if declared is not None:
        try:
            data = await request.content.readexactly(declared) if declared else b""
        except (asyncio.IncompleteReadError, ConnectionError) as exc:  # the client's fault
            raise web.HTTPBadRequest(reason="incomplete request body") from exc
        return data
    out = bytearray()
    async for chunk in request.content.iter_any():
        out += chunk
        if len(out) > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
    return bytes(out)
