"""OpenAI's Responses API on engines that keep what they answer (SGLang ``--enable-response-store``).

A stored response lives in the engine that made it, so what names it must go there:

  1. A ``/v1/responses`` request that does not say ``"store": false`` has its response's id pinned
     (``PinKind.RESPONSE``) to the replica that answers 200, unless that replica is known to keep
     nothing (``response_stores.StoreSupport``). The id is read from the first bytes that carry it (the
     unstreamed body's ``id``, a stream's ``response.created``) and pinned before those bytes go to
     the client, who cannot name the id sooner.
  2. A request whose ``previous_response_id`` is pinned goes to that replica only and is not retried
     elsewhere (the response exists there only); if that replica left the fleet it gets SGLang's 404.
     An id the gateway does not know (pinned longer ago than the session TTL, or before a gateway on
     embedded state restarted) is routed as usual: its session's home most likely holds it, and an
     engine that does not answers its own 404.
  3. ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the pinned replica. An id
     the gateway does not know is a 404 in SGLang's words: asking every replica would not scale to a
     fleet of a thousand. A 404 from the pinned replica (it restarted) drops the pin.
  4. The continuing request's body is not its prompt (the engine prepends the stored conversation),
     so it teaches nothing about tokens per byte.

A ``background`` response's load is kept until its engine has run it: ``background.py``.
"""

from __future__ import annotations

import re

from aiohttp import web

from router.config import GatewayConfig
from router.errors import BadRequestError, NotFoundError, StoreError
from router.events import StoreDegraded
from router.gateway.bodies import RESPONSE_ID, body_string, checked_session_id
from router.gateway.forward import filter_headers, read_limited, request_drop_set
from router.gateway.middleware import REQUEST_ID_HEADER, REQUEST_ID_KEY
from router.gateway.runtime import RUNTIME_KEY, GatewayRuntime
from router.model import PinKind, ReplicaId

__all__ = [
    "STORED_RESPONSE_ROUTES",
    "gone",
    "handle_stored_response",
    "keeps_response",
    "pin_response",
    "previous_response_id",
    "response_id_in",
]

STORED_RESPONSE_ROUTES = ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")

_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(' + RESPONSE_ID.encode() + rb')"')
_VALID_ID = re.compile(RESPONSE_ID)
_STORE_KEY = b'"store"'
_FORWARD_DROP = request_drop_set({REQUEST_ID_HEADER.lower(), "x-forwarded-for", "content-length"})
_ANSWER_LIMIT = 16 * 1024 * 1024


def keeps_response(body: bytes) -> bool:
    """Rule 1: the request leaves ``store`` at its default (true) or sets it true. Read off the bytes
    (a Codex body of 400 kB is not parsed for it): a nested ``"store": false`` only costs the pin,
    and the request then goes where its session goes."""
    i = body.find(_STORE_KEY)
    while i >= 0:
        rest = body[i + len(_STORE_KEY) : i + len(_STORE_KEY) + 16].lstrip()
        if rest.startswith(b":") and rest[1:].lstrip().startswith(b"false"):
            return False
        i = body.find(_STORE_KEY, i + 1)
    return True


def response_id_in(chunk: bytes) -> str | None:
    """The response id in a body's first bytes or a stream's first event, if they carry it."""
    m = _RESPONSE_ID.search(chunk)
    return m.group(1).decode() if m is not None else None


def previous_response_id(body: bytes, cfg: GatewayConfig) -> str | None:
    """The stored response a request continues; ``None`` when it names none (or names it in a way the
    engine will refuse: not a string)."""
    named = body_string(body, "previous_response_id")
    return None if named is None else checked_session_id("previous_response_id", named, cfg)


async def pin_response(rt: GatewayRuntime, response_id: str, replica_id: ReplicaId) -> None:
    """Rule 1. A store that fails costs the pin, never the response."""
    try:
        await rt.store.pin(PinKind.RESPONSE, response_id, replica_id)
    except StoreError as exc:
        rt.emit(StoreDegraded(at=rt.clock.now(), error=str(exc)))


async def gone(rt: GatewayRuntime, response_id: str, replica_id: ReplicaId, param: str) -> NotFoundError:
    """Rules 2 and 3: the replica that stored the response left the fleet, and the response with it."""
    await rt.store.unpin(PinKind.RESPONSE, response_id)
    return NotFoundError(
        f"Response with id '{response_id}' not found: it was stored on replica {replica_id}, which left "
        f"the fleet ({param})"
    )


def _not_found(response_id: str) -> NotFoundError:
    shown = response_id if len(response_id) <= 256 else response_id[:256] + "..."
    return NotFoundError(f"Response with id '{shown}' not found.")


async def handle_stored_response(request: web.Request) -> web.Response:
    """Rule 3: ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``."""
    rt = request.app[RUNTIME_KEY]
    name = request.match_info["response_id"]
    if not name.startswith("resp"):  # SGLang's own check, answered here as it would answer it
        raise BadRequestError(
            f"Invalid 'response_id': '{name[:256]}'. Expected an ID that begins with 'resp'."
        )
    if _VALID_ID.fullmatch(name) is None:
        raise _not_found(name)  # never pinned: not a shape the engine makes
    replica_id = await rt.store.pinned(PinKind.RESPONSE, name)
    if replica_id is None:
        raise _not_found(name)
    url = await rt.replica_url(replica_id)
    if url is None:
        raise await gone(rt, name, replica_id, "response_id")
    path = f"/v1/responses/{name}" + ("/cancel" if request.path.endswith("/cancel") else "")
    headers = filter_headers(request.headers.items(), _FORWARD_DROP)
    headers.append((REQUEST_ID_HEADER, request[REQUEST_ID_KEY]))
    client = rt.client
    assert client is not None, "gateway client not started"
    upstream = await client.send(replica_id, request.method, url + path, headers, b"")
    try:
        body = await read_limited(upstream.chunks(), _ANSWER_LIMIT)
    finally:
        if upstream.at_eof():
            upstream.release()
        else:
            upstream.abort()
    if upstream.status == 404:  # the engine restarted and lost it: so does the gateway
        await rt.store.unpin(PinKind.RESPONSE, name)
    return web.Response(
        status=upstream.status,
        body=body,
        headers={
            "Content-Type": upstream.content_type or "application/json",
            REQUEST_ID_HEADER: request[REQUEST_ID_KEY],
        },
    )
