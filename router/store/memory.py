"""In-memory state: the embedded default for one gateway, the simulator and the tests.

``MemoryCore`` is synchronous (the discrete-event simulator calls it directly, no event loop);
``MemoryStore`` is the async ``StateStore`` wrapper the gateway uses. Both read time only from the
injected clock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from router.clock import Clock
from router.model import (
    BindSession,
    ClusterSnapshot,
    Completion,
    EngineLoad,
    Lease,
    Reason,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
    SetOverflow,
)
from router.store.base import StoreConfig

__all__ = ["MemoryCore", "MemoryStore", "PLACEMENT_REASONS"]

# Bind reasons that count as a *placement* for the scale-up ramp cap.
PLACEMENT_REASONS = frozenset(
    {
        Reason.PLACED_NEW,
        Reason.PLACED_EVICTED,
        Reason.REASSIGNED_OVERLOAD,
        Reason.REASSIGNED_DRAINING,
        Reason.REASSIGNED_GONE,
        Reason.LEAST_LOADED,
        Reason.RANDOM,
        Reason.ROUND_ROBIN,
        Reason.HASH,
    }
)


@dataclass(slots=True)
class _Replica:
    spec: ReplicaSpec
    status: ReplicaStatus
    joined_at: float = 0.0
    in_flight: int = 0
    engine: EngineLoad = field(default_factory=EngineLoad)
    tokens_written: int = 0
    placements: deque[float] = field(default_factory=deque)
    # sessions homed here, ordered by last_seen (oldest first): sid -> (last_seen, context_tokens)
    active: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    active_context: int = 0


@dataclass(slots=True)
class _Session:
    home: ReplicaId | None = None
    overflow: tuple[ReplicaId, ...] = ()
    in_flight: dict[ReplicaId, int] = field(default_factory=dict)
    context_tokens: int = 0
    last_seen: float = 0.0
    residency_mark: int = 0
    turns: int = 0


class MemoryCore:
    """Synchronous state machine behind ``MemoryStore``."""

    def __init__(self, clock: Clock, config: StoreConfig | None = None) -> None:
        self.clock = clock
        self.config = config or StoreConfig()
        self._replicas: dict[ReplicaId, _Replica] = {}
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # ordered by last_seen
        self._seq = 0
        self._lease_ids = itertools.count(1)
        self._leases: dict[str, Lease] = {}

    # ---- registry ----------------------------------------------------------------------------

    def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        rep = self._replicas.get(spec.id)
        now = self.clock.now()
        if rep is None:
            st = status or ReplicaStatus.JOINING
            self._replicas[spec.id] = _Replica(
                spec=spec, status=st, joined_at=now if st is ReplicaStatus.ACTIVE else 0.0
            )
            return
        rep.spec = spec
        if status is not None:
            self.set_status(spec.id, status)

    def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        rep = self._replicas.get(replica_id)
        if rep is None:
            raise KeyError(replica_id)
        if status is ReplicaStatus.ACTIVE and rep.status is not ReplicaStatus.ACTIVE and rep.joined_at == 0.0:
            rep.joined_at = self.clock.now()
        rep.status = status

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self._replicas.pop(replica_id, None)

    def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.engine = load

    # ---- views -------------------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        horizon = now - self.config.session_ttl_s
        while self._sessions:
            sid, s = next(iter(self._sessions.items()))
            if s.last_seen >= horizon or any(s.in_flight.values()):
                break
            self._sessions.popitem(last=False)
            if s.home is not None and (rep := self._replicas.get(s.home)) is not None:
                self._forget_active(rep, sid)
        active_horizon = now - self.config.active_window_s
        ramp_horizon = now - self.config.ramp_window_s
        for rep in self._replicas.values():
            while rep.active:
                sid, (seen, ctx) = next(iter(rep.active.items()))
                if seen >= active_horizon:
                    break
                rep.active.popitem(last=False)
                rep.active_context -= ctx
            while rep.placements and rep.placements[0] < ramp_horizon:
                rep.placements.popleft()

    @staticmethod
    def _forget_active(rep: _Replica, sid: str) -> None:
        old = rep.active.pop(sid, None)
        if old is not None:
            rep.active_context -= old[1]

    @staticmethod
    def _touch_active(rep: _Replica, sid: str, seen: float, ctx: int) -> None:
        old = rep.active.pop(sid, None)
        if old is not None:
            rep.active_context -= old[1]
        rep.active[sid] = (seen, ctx)
        rep.active_context += ctx

    def _replica_state(self, rep: _Replica) -> ReplicaState:
        cap = rep.spec.capacity_tokens or rep.engine.capacity_tokens
        host = rep.spec.host_capacity_tokens or rep.engine.host_capacity_tokens
        return ReplicaState(
            id=rep.spec.id,
            url=rep.spec.url,
            status=rep.status,
            joined_at=rep.joined_at,
            in_flight=rep.in_flight,
            engine=rep.engine,
            capacity_tokens=cap,
            host_capacity_tokens=host,
            sessions_active=len(rep.active),
            active_context_tokens=rep.active_context,
            tokens_written=rep.tokens_written,
            placed_recent=len(rep.placements),
            model=rep.spec.model,
        )

    @staticmethod
    def _session_state(sid: str, s: _Session) -> SessionState:
        return SessionState(
            session_id=sid,
            home=s.home,
            overflow=s.overflow,
            in_flight=tuple(sorted((r, n) for r, n in s.in_flight.items() if n > 0)),
            context_tokens=s.context_tokens,
            last_seen=s.last_seen,
            residency_mark=s.residency_mark,
            turns=s.turns,
        )

    def replicas(self) -> tuple[ReplicaState, ...]:
        self._prune(self.clock.now())
        return tuple(self._replica_state(self._replicas[k]) for k in sorted(self._replicas))

    def session(self, session_id: str) -> SessionState | None:
        s = self._sessions.get(session_id)
        return None if s is None else self._session_state(session_id, s)

    def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        out = [self._session_state(sid, s) for sid, s in self._sessions.items() if s.home == replica_id]
        return tuple(out[-limit:])

    def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        self._prune(now)
        sess = self.session(session_key) if session_key else None
        return ClusterSnapshot(
            now=now,
            replicas=tuple(self._replica_state(self._replicas[k]) for k in sorted(self._replicas)),
            session=sess,
            seq=self._seq,
            sessions_active=sum(len(r.active) for r in self._replicas.values()),
        )

    # ---- hot path ----------------------------------------------------------------------------

    def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        now = self.clock.now()
        self._seq += 1
        target = decision.replica_id
        disagreement = False
        sid = request.session_key
        sess: _Session | None = None
        if sid is not None:
            sess = self._sessions.get(sid)
            if sess is None:
                sess = self._sessions[sid] = _Session(last_seen=now)
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                s = self._sessions.setdefault(eff.session_id, _Session(last_seen=now))
                if s.home != eff.only_if:
                    # compare-and-set lost: keep the existing home, route there if it is usable
                    if eff.replica_id == target and s.home is not None and s.home in self._replicas:
                        target = s.home
                        disagreement = True
                    continue
                if s.home is not None and (old := self._replicas.get(s.home)) is not None:
                    self._forget_active(old, eff.session_id)
                s.home = eff.replica_id
                s.overflow = tuple(r for r in s.overflow if r != eff.replica_id)
                s.residency_mark = 0  # nothing of this session is on the new home yet
                rep = self._replicas.get(eff.replica_id)
                if rep is not None:
                    if eff.reason in PLACEMENT_REASONS:
                        rep.placements.append(now)
                    self._touch_active(rep, eff.session_id, now, s.context_tokens)
            elif isinstance(eff, SetOverflow):
                s = self._sessions.setdefault(eff.session_id, _Session(last_seen=now))
                s.overflow = tuple(r for r in eff.replicas if r != s.home)
        rep = self._replicas.get(target)
        if rep is None:
            raise KeyError(target)
        rep.in_flight += 1
        prev_ctx = 0
        if sess is not None and sid is not None:
            sess.in_flight[target] = sess.in_flight.get(target, 0) + 1
            sess.last_seen = now
            self._sessions.move_to_end(sid)
            prev_ctx = sess.context_tokens
            if sess.home is not None and (home := self._replicas.get(sess.home)) is not None:
                self._touch_active(home, sid, now, sess.context_tokens)
        lease = Lease(
            lease_id=f"m{next(self._lease_ids)}",
            replica_id=target,
            session_id=sid,
            reason=decision.reason,
            acquired_at=now,
            disagreement=disagreement,
            prev_context_tokens=prev_ctx,
        )
        self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease: Lease, completion: Completion) -> None:
        if self._leases.pop(lease.lease_id, None) is None:
            return  # double release is a no-op: load must never go negative
        now = self.clock.now()
        rep = self._replicas.get(lease.replica_id)
        if rep is not None:
            rep.in_flight = max(0, rep.in_flight - 1)
            if completion.prompt_tokens is not None:
                new = completion.prompt_tokens - (completion.cached_tokens or 0)
                rep.tokens_written += max(0, new) + (completion.completion_tokens or 0)
        if lease.session_id is None:
            return
        s = self._sessions.get(lease.session_id)
        if s is None:
            return
        n = s.in_flight.get(lease.replica_id, 0) - 1
        if n > 0:
            s.in_flight[lease.replica_id] = n
        else:
            s.in_flight.pop(lease.replica_id, None)
        s.last_seen = now
        self._sessions.move_to_end(lease.session_id)
        if completion.ok and completion.prompt_tokens is not None:
            ctx = completion.prompt_tokens + (completion.completion_tokens or 0)
            if lease.replica_id == s.home:
                s.context_tokens = max(s.context_tokens, ctx) if s.in_flight else ctx
                s.turns += 1
                if rep is not None:
                    s.residency_mark = rep.tokens_written
        if s.home is not None and (home := self._replicas.get(s.home)) is not None:
            self._touch_active(home, lease.session_id, now, s.context_tokens)

    def leases(self) -> tuple[Lease, ...]:
        return tuple(self._leases.values())


class MemoryStore:
    """Async ``StateStore`` over a ``MemoryCore`` (one process; nothing to start)."""

    def __init__(self, clock: Clock, config: StoreConfig | None = None) -> None:
        self.core = MemoryCore(clock, config)

    async def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        return self.core.snapshot(session_key)

    async def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        return self.core.acquire(decision, request)

    async def release(self, lease: Lease, completion: Completion) -> None:
        self.core.release(lease, completion)

    async def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        self.core.upsert_replica(spec, status)

    async def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        self.core.set_status(replica_id, status)

    async def remove_replica(self, replica_id: ReplicaId) -> None:
        self.core.remove_replica(replica_id)

    async def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        self.core.report_engine_load(replica_id, load)

    async def replicas(self) -> tuple[ReplicaState, ...]:
        return self.core.replicas()

    async def session(self, session_id: str) -> SessionState | None:
        return self.core.session(session_id)

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        return self.core.sessions_on(replica_id, limit)

    async def close(self) -> None:
        return None

