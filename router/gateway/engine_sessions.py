"""SGLang's engine sessions through the gateway: ``/open_session``, ``/close_session`` and
``/generate`` with ``session_params``.

An engine session lives in one engine (its request tree, and with ``--enable-session-radix-cache``
the references that keep its KV), so the gateway pins it:

  1. ``/open_session`` is placed by the policy like a session's first request (keyed by the
     ``Modal-Session-Id`` header, else by the engine session's id). A body without ``session_id``
     gets one here (as SGLang would make one), so the pin is known before the engine answers.
     An id already open behind this gateway is refused (400), as one engine refuses it.
  2. The replica that answers 200 is pinned (``StateStore.pin``) before the client
     has the answer: its next request cannot race the pin.
  3. ``/generate`` naming ``session_params.id`` and ``/close_session`` go to the pinned replica only:
     never retried elsewhere, where the session does not exist. A session the gateway does not know
     (never opened through it, closed, idle longer than the session TTL) is a 404; one whose replica
     left the fleet is a 404 too, and its pin is dropped.
  4. ``/close_session`` answered 200 drops the pin. SGLang ignores ``session_params`` on its OpenAI
     routes (0.5.23), and so does the gateway there.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import orjson

from router.config import GatewayConfig
from router.errors import BadRequestError, NotFoundError
from router.gateway.bodies import body_field, checked_session_id, parse_body
from router.model import PinKind, ReplicaId
from router.store.base import StateStore

__all__ = ["CLOSE_ROUTE", "OPEN_ROUTE", "SESSION_ROUTES", "EngineSessionCall", "engine_session_call"]

OPEN_ROUTE = "/open_session"
CLOSE_ROUTE = "/close_session"
SESSION_ROUTES = (OPEN_ROUTE, CLOSE_ROUTE)


@dataclass(frozen=True, slots=True)
class EngineSessionCall:
    """A request that opens, uses or closes one engine session."""

    route: str
    session_id: str
    body: bytes  # what to forward: an open without an id gets the gateway's

    @property
    def opens(self) -> bool:
        return self.route == OPEN_ROUTE

    async def pinned(self, store: StateStore) -> ReplicaId | None:
        """Rule 3: where a use or a close must go (``None`` for an open: the policy places it)."""
        rid = await store.pinned(PinKind.ENGINE_SESSION, self.session_id)
        if self.opens:
            if rid is not None:
                raise BadRequestError(f"engine session {self.session_id!r} is already open")
            return None
        if rid is None:
            raise NotFoundError(
                f"engine session {self.session_id!r} is not open behind this gateway "
                f"(open it with {OPEN_ROUTE} through the gateway)"
            )
        return rid

    async def replica_gone(self, store: StateStore, replica_id: ReplicaId) -> NotFoundError:
        await store.unpin(PinKind.ENGINE_SESSION, self.session_id)
        return NotFoundError(
            f"engine session {self.session_id!r} was open on replica {replica_id}, which left the fleet"
        )

    async def answered(self, store: StateStore, replica_id: ReplicaId, status: int) -> None:
        """Rules 2 and 4, before the answer is relayed."""
        if status != 200:
            return
        if self.opens:
            await store.pin(PinKind.ENGINE_SESSION, self.session_id, replica_id)
        elif self.route == CLOSE_ROUTE:
            await store.unpin(PinKind.ENGINE_SESSION, self.session_id)


def engine_session_call(route: str, body: bytes, cfg: GatewayConfig) -> EngineSessionCall | None:
    """What ``body`` does to an engine session on ``route``; ``None`` for an ordinary request.
    ``BadRequestError`` for a session route whose body names no usable session."""
    if route == "/generate":
        params = body_field(body, "session_params")
        sid = params.get("id") if isinstance(params, dict) else None
        if not isinstance(sid, str) or not sid:
            return None
        return EngineSessionCall(route, checked_session_id("session_params.id", sid, cfg), body)
    if route not in SESSION_ROUTES:
        return None
    obj = parse_body(body)
    sid = obj.get("session_id")
    if sid is None and route == OPEN_ROUTE:
        sid = obj["session_id"] = uuid.uuid4().hex
        body = orjson.dumps(obj)
    if not isinstance(sid, str) or not sid:
        raise BadRequestError(f"{route}: session_id must be a non-empty string")
    return EngineSessionCall(route, checked_session_id("session_id", sid, cfg), body)
