"""SGLang's engine sessions through the gateway: ``/open_session``, ``/close_session`` and
``/generate`` with ``session_params``.

An engine session lives in one engine (its request tree, and with ``--enable-session-radix-cache``
the references that keep its KV), so the gateway pins it:

  1. ``/open_session`` is placed by the policy like a session's first request (keyed by the
     ``Modal-Session-Id`` header, else by the engine session's id). A body without ``session_id``
     gets one here (as SGLang would make one), so the pin is known before the engine answers.
     The id is reserved first (``StateStore.reserve``: set only if absent, so of two opens racing
     through any gateways of one store exactly one gets it): an id already open or being opened
     is refused (400), as one engine refuses it.
  2. The replica that answers 200 is pinned (``StateStore.pin``) before the client
     has the answer: its next request cannot race the pin. Any other outcome (an error status, no
     answer, the client gone) frees the reservation. A request naming an id still being opened is
     a 404, as the engine would answer it.
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

__all__ = ["CLOSE_ROUTE", "OPENING", "OPEN_ROUTE", "SESSION_ROUTES", "EngineSessionCall", "engine_session_call"]

OPEN_ROUTE = "/open_session"
CLOSE_ROUTE = "/close_session"
SESSION_ROUTES = (OPEN_ROUTE, CLOSE_ROUTE)


# what an id being opened is pinned to until its engine answers: no replica id has a comma
# (docs/REDIS.md), so it never names one
OPENING: ReplicaId = ","


@dataclass(slots=True)
class EngineSessionCall:
    """A request that opens, uses or closes one engine session."""

    route: str
    session_id: str
    body: bytes  # what to forward: an open without an id gets the gateway's
    reserved: bool = False  # an open holding its id's reservation, not yet settled by an answer

    @property
    def opens(self) -> bool:
        return self.route == OPEN_ROUTE

    async def pinned(self, store: StateStore) -> ReplicaId | None:
        """Rule 3: where a use or a close must go (``None`` for an open: the policy places it)."""
        if self.opens:
            if not await store.reserve(PinKind.ENGINE_SESSION, self.session_id, OPENING):
                raise BadRequestError(f"engine session {self.session_id!r} is already open")
            self.reserved = True
            return None
        rid = await store.pinned(PinKind.ENGINE_SESSION, self.session_id)
        if rid is None:
            raise NotFoundError(
                f"engine session {self.session_id!r} is not open behind this gateway "
                f"(open it with {OPEN_ROUTE} through the gateway)"
            )
        if rid == OPENING:
            raise NotFoundError(f"engine session {self.session_id!r} is still being opened")
        return rid

    async def replica_gone(self, store: StateStore, replica_id: ReplicaId) -> NotFoundError:
        await store.unpin(PinKind.ENGINE_SESSION, self.session_id)
        return NotFoundError(
            f"engine session {self.session_id!r} was open on replica {replica_id}, which left the fleet"
        )

    async def answered(self, store: StateStore, replica_id: ReplicaId, status: int) -> None:
        """Rules 2 and 4, before the answer is relayed."""
        if self.opens:
            self.reserved = False
            if status == 200:
                await store.pin(PinKind.ENGINE_SESSION, self.session_id, replica_id)
            else:
                await store.unpin(PinKind.ENGINE_SESSION, self.session_id)
        elif self.route == CLOSE_ROUTE and status == 200:
            await store.unpin(PinKind.ENGINE_SESSION, self.session_id)

    async def abandoned(self, store: StateStore) -> None:
        """Rule 2: an open that ended without an answer (every replica failed, the client left)
        frees its id."""
        if self.reserved:
            self.reserved = False
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
