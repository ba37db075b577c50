"""Cross-cutting HTTP concerns of the gateway: request ids, error mapping, body limits, response
counting - in one middleware layer (:func:`make_gateway_middleware`): each aiohttp middleware layer
costs a coroutine and a handler wrapper per request, and these concerns run on every request.

Rules:
  1. Every response (success, error, stream) carries ``X-Request-Id``: the client's own if it is
     a sane token (≤ 128 chars of ``[A-Za-z0-9._:-]``), else a fresh unique id of 32 hex
     chars (a random per-process prefix + a counter: uuid4 read /dev/urandom on every request).
     It is also set in the logging context so every log line of the request names it. The
     middleware adds it to every response a handler returns unsent; a handler that streams (sends
     its headers itself) adds it before it does (``handlers.py``).
  2. ``router.errors`` and aiohttp's HTTP exceptions become OpenAI-style JSON
     (``{"error": {"message", "type", "code"}}``) with the matching status and an
     ``X-Kvroute-Error`` header naming the code. Nothing else is caught here: an unexpected
     exception is a bug and gets a JSON 500 without internals.
  3. Body size: a declared ``Content-Length`` over the limit is refused with 413 before a byte of
     the body is read; a chunked body is counted while read and refused as soon as it crosses it.
  4. Header size is enforced by aiohttp's parser (``max_field_size``/``max_line_size``/
     ``max_headers`` from ``limits``); it answers 400 and closes the connection. The parser fails
     before any middleware runs, so the runner's request handler renders that answer as the same
     JSON error (``serve._JsonErrorsRequestHandler``).
  5. No secrets in logs: ``router.observability.logging`` redacts credentials; this module never
     logs header values.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from router.errors import KvrouteError, PayloadTooLargeError, UpstreamStatusError
from router.observability.logging import set_request_id

__all__ = [
    "REQUEST_ID_HEADER",
    "REQUEST_ID_KEY",
    "GatewayMiddleware",
    "ResponseObserver",
    "error_middleware",
    "error_payload",
    "error_response",
    "kvroute_error_status",
    "make_gateway_middleware",
    "read_body_limited",
    "request_id_for",
    "request_id_middleware",
    "route_label",
    "set_request_id_header",
]

log = logging.getLogger("kvroute.gateway")

REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_KEY = web.RequestKey("kvroute_request_id", str)
_SANE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ResponseObserver = Callable[[str, str, "int | str"], None]
"""Called once per request with its route (the matched resource's template, ``"unmatched"``, never
the raw path), method and final status (``"error"``: an exception escaped)."""


def route_label(request: web.Request) -> str:
    """The route a response is counted under: the matched resource's template, never the raw path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class _RequestIds:
    """Unique request ids, 32 hex chars: 64 random bits per process (new after a fork) + a counter."""

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


def error_payload(message: str, error_type: str, code: str | int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": code}}


def error_response(
    status: int, message: str, error_type: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    hdrs = {"X-Kvroute-Error": code}
    if headers:
        hdrs.update(headers)
    return web.json_response(error_payload(message, error_type, code), status=status, headers=hdrs)


def kvroute_error_status(exc: KvrouteError) -> int:
    """The status a ``KvrouteError`` answers with (a replica's own 5xx becomes 502)."""
    return 502 if isinstance(exc, UpstreamStatusError) else exc.status


def _from_kvroute(exc: KvrouteError) -> web.Response:
    return error_response(kvroute_error_status(exc), str(exc) or exc.code, exc.error_type, exc.code)


@web.middleware
async def request_id_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request_id_for(request.headers.get(REQUEST_ID_HEADER))
    request[REQUEST_ID_KEY] = rid
    token = set_request_id(rid)  # every log line of this request names it
    try:
        return await handler(request)
    finally:
        token.var.reset(token)


async def set_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` signal: runs for every response, streamed or not, before headers go out."""
    rid = request.get(REQUEST_ID_KEY)
    if rid is not None and REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = rid


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


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except KvrouteError as exc:
        if exc.status >= 500:
            log.warning("%s %s -> %s: %s", request.method, request.path, exc.code, exc)
        return _from_kvroute(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like are not errors
        return _from_http(request, exc)


class GatewayMiddleware:
    """Request id + error mapping + response observers as one aiohttp middleware (module rules 1-2).

    ``observers`` (e.g. the HTTP response counter of ``router.observability.metrics``) are called
    with the request and its final status after errors were mapped; ``make_app`` folds such
    observer middlewares into this one instead of running them as layers of their own."""

    __middleware_version__ = 1  # what @web.middleware marks: new-style (request, handler)

    def __init__(self, observers: Sequence[ResponseObserver] = ()) -> None:
        self.observers: tuple[ResponseObserver, ...] = tuple(observers)

    def add_observer(self, observer: ResponseObserver) -> None:
        self.observers = (*self.observers, observer)

    def observe(self, route: str, method: str, status: int | str) -> None:
        """Count one response that did not pass through aiohttp (the raw data plane's)."""
        for obs in self.observers:
            obs(route, method, status)

    def _observe(self, request: web.Request, status: int | str) -> None:
        if self.observers:
            self.observe(route_label(request), request.method, status)

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
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
                    self._observe(request, exc.status)
                    raise  # redirects and the like are not errors
                resp = _from_http(request, exc)
            except BaseException:
                self._observe(request, "error")
                raise
            if not resp.prepared and REQUEST_ID_HEADER not in resp.headers:
                resp.headers[REQUEST_ID_HEADER] = rid
            if self.observers:
                self._observe(request, resp.status)
            return resp
        finally:
            token.var.reset(token)


def make_gateway_middleware(observers: Sequence[ResponseObserver] = ()) -> GatewayMiddleware:
    return GatewayMiddleware(observers)


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
