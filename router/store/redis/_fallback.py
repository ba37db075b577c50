"""Degraded mode of the Redis store: serving from local state while Redis is away.

Rules:
  1. On an error or a timeout the store turns *degraded* (``enter``): from then on it serves from a
     local ``MemoryCore`` mirror built from the replicas last seen plus the registry writes this
     process made itself. Sessions last seen keep their home (``seed``); new ones are placed by the
     policy, whose rendezvous tie-break agrees across gateways.
  2. What happened meanwhile is kept for the resync: registry writes to replay (``pending``), and
     the bindings made locally (``binds``: session -> home, the home it replaced, context), which
     are republished with compare-and-set.
  3. Leases served by the mirror are released to the mirror, never to Redis.
  4. Only public ``MemoryCore`` calls: the mirror is the reference store, driven like any caller.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from router.clock import Clock
from router.model import (
    BindSession,
    ClusterSnapshot,
    Completion,
    Lease,
    Reason,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
)
from router.store.base import StoreConfig
from router.store.memory import MemoryCore
from router.store.redis._wire import RedisWire

__all__ = ["Fallback"]

log = logging.getLogger("kvroute.store.redis")

_SESSIONS_MAX = 50_000


class Fallback:
    """Local state for outages (rules 1-4), and the counters that describe them."""

    def __init__(self, wire: RedisWire, clock: Clock, config: StoreConfig, gateway_id: str) -> None:
        self._wire = wire
        self._clock = clock
        self._config = config
        self._gateway_id = gateway_id
        self.degraded = False
        self.degraded_total = 0
        self.fallback_total = 0  # operations served locally because Redis failed or was away
        self.resync_total = 0
        self.mirror: MemoryCore | None = None
        self.last_replicas: tuple[ReplicaState, ...] = ()  # what a mirror would start from
        self.registered: dict[str, tuple[ReplicaSpec, ReplicaStatus]] = {}  # our own registry writes
        self.sessions: OrderedDict[str, SessionState] = OrderedDict()  # last seen homes
        self.pending: list[Callable[[], Awaitable[None]]] = []  # registry writes to replay
        self.binds: dict[str, tuple[ReplicaId, ReplicaId | None, int]] = {}  # made while degraded
        self._local: dict[str, tuple[MemoryCore, Lease]] = {}  # our lease id -> mirror and its lease

    @property
    def local_leases(self) -> int:
        return len(self._local)

    def enter(self, exc: BaseException) -> None:
        if not self.degraded:
            self.degraded = True
            self.degraded_total += 1
            self.mirror = self._build()
            log.warning("redis unavailable, serving from local state: %s", exc)

    def leave(self) -> None:
        self.degraded = False
        self.mirror = None
        self.resync_total += 1

    def remember(self, s: SessionState) -> None:
        self.sessions[s.session_id] = s
        self.sessions.move_to_end(s.session_id)
        if len(self.sessions) > _SESSIONS_MAX:
            self.sessions.popitem(last=False)

    def _build(self) -> MemoryCore:
        core = MemoryCore(self._clock, self._config)
        seen = set()
        for r in self.last_replicas:
            core.upsert_replica(self._wire.spec_of(r.id, r.url, r.model), r.status)
            core.report_engine_load(r.id, r.engine)
            seen.add(r.id)
        for rid, (spec, status) in self.registered.items():
            if rid not in seen:
                core.upsert_replica(spec, status)
        return core

    def core(self) -> MemoryCore:
        if self.mirror is None:
            self.mirror = self._build()
        return self.mirror

    def seed(self, mirror: MemoryCore, sid: str) -> None:
        """Give the mirror a session's home as Redis last told us (rule 4: public API only)."""
        known = self.sessions.get(sid)
        if known is None or known.home is None:
            return
        if mirror.session(sid) is not None:
            return
        if known.home not in {r.id for r in mirror.replicas()}:
            return
        lease = mirror.acquire(
            RouteDecision(
                replica_id=known.home,
                reason=Reason.AFFINITY,
                effects=(BindSession(sid, known.home, None, Reason.AFFINITY),),
            ),
            RouteRequest(session_key=None),
        )
        mirror.release(lease, Completion(ok=False))

    # ---- StateStore calls served locally ------------------------------------------------------------

    def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        self.fallback_total += 1
        mirror = self.core()
        if session_key is not None:
            self.seed(mirror, session_key)
        return mirror.snapshot(session_key)

    def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        self.fallback_total += 1
        mirror = self.core()
        for eff in decision.effects:
            self.seed(mirror, eff.session_id)
            if isinstance(eff, BindSession):
                before = mirror.session(eff.session_id)
                self.binds.setdefault(
                    eff.session_id,
                    (eff.replica_id, before.home if before else None, before.context_tokens if before else 0),
                )
        if request.session_key is not None:
            self.seed(mirror, request.session_key)
        lease = mirror.acquire(decision, request)
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                s = mirror.session(eff.session_id)
                prev = self.binds.get(eff.session_id)
                if s is not None and s.home is not None and prev is not None:
                    self.binds[eff.session_id] = (s.home, prev[1], s.context_tokens)
        local = Lease(
            lease_id=f"{self._gateway_id}/local/{lease.lease_id}",
            replica_id=lease.replica_id,
            session_id=lease.session_id,
            reason=lease.reason,
            acquired_at=lease.acquired_at,
            disagreement=lease.disagreement,
            prev_context_tokens=lease.prev_context_tokens,
        )
        self._local[local.lease_id] = (mirror, lease)
        return local

    def release(self, lease: Lease, completion: Completion) -> bool:
        """Release a lease the mirror served (rule 3); False if it is not one of those."""
        held = self._local.pop(lease.lease_id, None)
        if held is None:
            return False
        mirror, inner = held
        mirror.release(inner, completion)
        return True

    def session(self, session_id: str) -> SessionState | None:
        self.fallback_total += 1
        mirror = self.core()
        self.seed(mirror, session_id)
        return mirror.session(session_id)

    def sessions_on(self, replica_id: ReplicaId, limit: int) -> tuple[SessionState, ...]:
        self.fallback_total += 1
        return self.core().sessions_on(replica_id, limit)

    # ---- resync ---------------------------------------------------------------------------------------

    def keep_all_homes(self) -> None:
        """Redis came back empty: every home we have seen is republished (rule 2)."""
        for sid, known in list(self.sessions.items()):
            if known.home is not None and sid not in self.binds:
                self.binds[sid] = (known.home, None, known.context_tokens)
