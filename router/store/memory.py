"""In-memory state: the embedded default for one gateway, the simulator and the tests.

``MemoryCore`` is synchronous (the discrete-event simulator calls it directly, no event loop);
``MemoryStore`` is the async ``StateStore`` wrapper the gateway uses. Both read time only from the
injected clock.

Hot path (``snapshot`` runs once per request): each replica's immutable ``ReplicaState`` is cached
and rebuilt only after something it shows changed (``_dirty``); the sorted list of them is patched
in place for the replicas that changed (the tuple handed out is a C-speed copy of it); the
fleet-wide active-session count is kept as a running total; and expiry pops the oldest entries of
two fleet-wide time-ordered indexes (active sessions per replica, placements) instead of visiting
every replica, so a request costs O(changes), not O(replicas). A clock that goes back breaks the
time order: from then on every call prunes with a full pass. Results are exactly those of
rebuilding and pruning everything on every call.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.clock import Clock
from router.errors import ReplicaNotFoundError
from router.model import (
    BindSession,
    ClusterSnapshot,
    Completion,
    EngineLoad,
    FleetTotals,
    HealthStamp,
    Lease,
    PinKind,
    Reason,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
    SetOverflow,
    capacities,
    fleet_totals,
    remember_chain,
)
from router.residency import ResidencyView, unbound_with_residency, with_residency
from router.store.base import StoreConfig, learn_horizon, residency_feedback

__all__ = ["PLACEMENT_REASONS", "MemoryCore", "MemoryStore", "Pins"]

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
    horizon: int = 0  # residency horizon learned from the engine's answers (rule 6 feedback)
    placements: deque[float] = field(default_factory=deque)
    # sessions homed here, ordered by last_seen (oldest first): sid -> (last_seen, context_tokens)
    active: OrderedDict[str, tuple[float, int]] = field(default_factory=OrderedDict)
    active_context: int = 0
    state: ReplicaState | None = None  # cached view; None = rebuild on the next read


@dataclass(slots=True)
class _Session:
    home: ReplicaId | None = None
    overflow: tuple[ReplicaId, ...] = ()
    in_flight: dict[ReplicaId, int] = field(default_factory=dict)
    context_tokens: int = 0
    context_at: float = 0.0  # when ``context_tokens`` was last raised (or set)
    last_seen: float = 0.0
    residency_mark: int = 0
    turns: int = 0
    bytes_per_token: float = 0.0
    chains: tuple[tuple[str, ReplicaId], ...] = ()


class Pins:
    """What lives in one engine only (``PinKind``: SGLang engine sessions, stored responses) and the
    replica each lives on, forgotten ``ttl_s`` after their last use."""

    def __init__(self, clock: Clock, ttl_s: float) -> None:
        self.clock = clock
        self.ttl_s = ttl_s
        self._pins: OrderedDict[tuple[PinKind, str], tuple[ReplicaId, float]] = OrderedDict()  # -> (replica, last use)

    def _prune(self, now: float) -> None:
        horizon = now - self.ttl_s
        while self._pins:
            _, used = next(iter(self._pins.values()))
            if used > horizon:
                break
            self._pins.popitem(last=False)

    def pin(self, kind: PinKind, name: str, replica_id: ReplicaId) -> None:
        key = (kind, name)
        now = self.clock.now()
        self._pins[key] = (replica_id, now)
        self._pins.move_to_end(key)
        self._prune(now)

    def get(self, kind: PinKind, name: str) -> ReplicaId | None:
        key = (kind, name)
        now = self.clock.now()
        self._prune(now)
        pin = self._pins.get(key)
        if pin is None or pin[1] <= now - self.ttl_s:  # the second: out of order after the clock went back
            self._pins.pop(key, None)
            return None
        self.pin(kind, name, pin[0])
        return pin[0]

    def reserve(self, kind: PinKind, name: str, replica_id: ReplicaId) -> bool:
        if self.get(kind, name) is not None:
            return False
        self.pin(kind, name, replica_id)
        return True

    def unpin(self, kind: PinKind, name: str) -> None:
        self._pins.pop((kind, name), None)


def _sums_of(st: ReplicaState) -> tuple[int, int, int, int, int, int, int]:
    """One replica's share of each ``FleetTotals`` field, in field order."""
    if st.status is ReplicaStatus.ACTIVE:
        return 1, 1, 0, 0, st.in_flight, st.sessions_active, st.placed_recent
    return 1, 0, int(st.status is ReplicaStatus.JOINING), int(st.status is ReplicaStatus.DOWN), 0, 0, 0


class MemoryCore:
    """Synchronous state machine behind ``MemoryStore``."""

    def __init__(self, clock: Clock, config: StoreConfig | None = None) -> None:
        self.clock = clock
        self.config = config or StoreConfig()
        # exact residency from KV events (router/residency.py): fills SessionState.resident_* when set
        self.residency: ResidencyView | None = None
        self._replicas: dict[ReplicaId, _Replica] = {}
        self.health: dict[ReplicaId, HealthStamp] = {}  # shared good health checks (discovery rule 7)
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # ordered by last_seen
        self._seq = 0
        self._serving_since: float | None = None  # the first acquire: later ACTIVE replicas scaled up
        self._lease_ids = itertools.count(1)
        self._leases: dict[str, Lease] = {}
        # the registration each lease counted on: a replica removed and registered again under the
        # same id while the lease ran is a new registration, whose count the lease never raised
        self._lease_rep: dict[str, _Replica] = {}
        # ---- caches of the read path (see the module docstring) ----
        self._view: tuple[ReplicaState, ...] | None = None  # sorted by id; None = rebuild
        self._order: tuple[_Replica, ...] | None = None  # replicas sorted by id; None = re-sort
        self._states: list[ReplicaState] = []  # the view being patched, aligned with ``_order``
        self._stale: dict[int, _Replica] = {}  # id(rep) -> rep whose entry in ``_states`` is out of date
        self._pos: dict[ReplicaId, int] = {}  # replica id -> index in ``_order`` (replaced, never mutated)
        self._sums: list[int] = [0] * 7  # the fields of ``FleetTotals`` over ``_states``, running
        self._totals = FleetTotals()
        self._n_active = 0  # sum of len(rep.active) over the registered replicas
        # fleet-wide time order of the entries that expire (valid while the clock is monotonic):
        # (replica, session) -> last seen, oldest first; (placed at, replica), oldest first
        self._active_order: OrderedDict[tuple[ReplicaId, str], tuple[float, _Replica]] = OrderedDict()
        self._placement_order: deque[tuple[float, _Replica]] = deque()
        self._last_now = float("-inf")
        self._monotonic = True  # False once the clock went back: then always prune fully
        self.pins = Pins(clock, self.config.session_ttl_s)
        self.config_doc: tuple[int, str | None] = (0, None)  # the shared policy config (generation, JSON)

    def _dirty(self, rep: _Replica) -> None:
        rep.state = None
        self._stale[id(rep)] = rep
        self._view = None

    # ---- registry ----------------------------------------------------------------------------

    def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        rep = self._replicas.get(spec.id)
        now = self.clock.now()
        if rep is None:
            st = status or ReplicaStatus.JOINING
            self._replicas[spec.id] = _Replica(
                spec=spec, status=st, joined_at=now if st is ReplicaStatus.ACTIVE else 0.0
            )
            self._order = None
            self._view = None
            return
        rep.spec = spec
        self._dirty(rep)
        if status is not None:
            self.set_status(spec.id, status)

    def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        rep = self._replicas.get(replica_id)
        if rep is None:
            raise ReplicaNotFoundError(replica_id)
        if status is ReplicaStatus.ACTIVE and rep.status is not ReplicaStatus.ACTIVE and rep.joined_at == 0.0:
            rep.joined_at = self.clock.now()
        rep.status = status
        self._dirty(rep)

    def remove_replica(self, replica_id: ReplicaId) -> None:
        self.health.pop(replica_id, None)
        rep = self._replicas.pop(replica_id, None)
        if rep is not None:
            self._n_active -= len(rep.active)
            self._order = None
            self._view = None

    def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        rep = self._replicas.get(replica_id)
        if rep is not None:
            rep.engine = load
            self._dirty(rep)

    def report_health(self, stamps: Mapping[ReplicaId, HealthStamp]) -> None:
        self.health.update((rid, st) for rid, st in stamps.items() if rid in self._replicas)

    # ---- views -------------------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        if now < self._last_now:
            self._monotonic = False
        self._last_now = now
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
        if not self._monotonic:
            self._prune_all(active_horizon, ramp_horizon)
            return
        order = self._active_order
        while order:
            (rid, sid), (seen, rep) = next(iter(order.items()))
            if seen >= active_horizon:
                break
            order.popitem(last=False)
            old = rep.active.get(sid)
            if old is not None and old[0] < active_horizon and self._replicas.get(rid) is rep:
                del rep.active[sid]
                rep.active_context -= old[1]
                self._n_active -= 1
                self._dirty(rep)
        placed = self._placement_order
        while placed and placed[0][0] < ramp_horizon:
            _, rep = placed.popleft()
            if rep.placements and rep.placements[0] < ramp_horizon:
                rep.placements.popleft()
                if self._replicas.get(rep.spec.id) is rep:
                    self._dirty(rep)

    def _prune_all(self, active_horizon: float, ramp_horizon: float) -> None:
        """Drop expired entries replica by replica (the clock went back: the time order is gone)."""
        for rep in self._replicas.values():
            changed = False
            while rep.active:
                _, (seen, ctx) = next(iter(rep.active.items()))
                if seen >= active_horizon:
                    break
                rep.active.popitem(last=False)
                rep.active_context -= ctx
                self._n_active -= 1
                changed = True
            while rep.placements and rep.placements[0] < ramp_horizon:
                rep.placements.popleft()
                changed = True
            if changed:
                self._dirty(rep)

    def _forget_active(self, rep: _Replica, sid: str) -> None:
        old = rep.active.pop(sid, None)
        if old is not None:
            rep.active_context -= old[1]
            self._n_active -= 1
            self._active_order.pop((rep.spec.id, sid), None)
            self._dirty(rep)

    def _touch_active(self, rep: _Replica, sid: str, seen: float, ctx: int) -> None:
        old = rep.active.pop(sid, None)
        if old is not None:
            rep.active_context -= old[1]
        else:
            self._n_active += 1
        rep.active[sid] = (seen, ctx)
        rep.active_context += ctx
        if self._monotonic:
            key = (rep.spec.id, sid)
            self._active_order.pop(key, None)
            self._active_order[key] = (seen, rep)
        self._dirty(rep)

    def _place(self, rep: _Replica, now: float) -> None:
        rep.placements.append(now)
        if self._monotonic:
            self._placement_order.append((now, rep))
        self._dirty(rep)

    def _replica_state(self, rep: _Replica) -> ReplicaState:
        st = rep.state
        if st is None:
            st = rep.state = self._build_state(rep)
        return st

    def _replica_view(self) -> tuple[ReplicaState, ...]:
        view = self._view
        if view is None:
            order = self._order
            if order is None:
                order = self._order = tuple(self._replicas[k] for k in sorted(self._replicas))
                self._pos = {r.spec.id: i for i, r in enumerate(order)}
                self._states = [self._replica_state(r) for r in order]
                t = fleet_totals(tuple(self._states))
                self._sums = [t.replicas, t.active, t.joining, t.down, t.active_in_flight,
                              t.active_sessions, t.active_placed_recent]
            else:
                states, pos, reps, sums = self._states, self._pos, self._replicas, self._sums
                for rep in self._stale.values():
                    rid = rep.spec.id
                    if reps.get(rid) is rep:
                        i = pos[rid]
                        old, new = states[i], self._replica_state(rep)
                        states[i] = new
                        for k, (a, b) in enumerate(zip(_sums_of(old), _sums_of(new), strict=True)):
                            sums[k] += b - a
            self._stale.clear()
            self._totals = FleetTotals(*self._sums)
            view = self._view = tuple(self._states)
        return view

    @staticmethod
    def _build_state(rep: _Replica) -> ReplicaState:
        cap, host = capacities(rep.spec, rep.engine)
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
            residency_horizon_tokens=rep.horizon,
            dp_rank=rep.spec.dp_rank,
        )

    def _session_state(self, sid: str, s: _Session) -> SessionState:
        st = SessionState(
            session_id=sid,
            home=s.home,
            overflow=s.overflow,
            in_flight=tuple(sorted((r, n) for r, n in s.in_flight.items() if n > 0)),
            context_tokens=s.context_tokens,
            last_seen=s.last_seen,
            residency_mark=s.residency_mark,
            turns=s.turns,
            bytes_per_token=s.bytes_per_token,
            chains=s.chains,
        )
        return st if self.residency is None else with_residency(st, self.residency)

    def replicas(self) -> tuple[ReplicaState, ...]:
        self._prune(self.clock.now())
        return self._replica_view()

    def session(self, session_id: str) -> SessionState | None:
        s = self._sessions.get(session_id)
        return None if s is None else self._session_state(session_id, s)

    def session_home(self, session_id: str) -> ReplicaId | None:
        """``session(session_id).home`` without building the ``SessionState`` (the simulator asks
        after every acquire)."""
        s = self._sessions.get(session_id)
        return None if s is None else s.home

    def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        out = [self._session_state(sid, s) for sid, s in self._sessions.items() if s.home == replica_id]
        return tuple(out[-limit:])

    def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        self._prune(now)
        sess = self.session(session_key) if session_key else None
        if sess is None and session_key and self.residency is not None:
            sess = unbound_with_residency(session_key, self.residency)
        view = self._replica_view()  # brings ``_totals`` up to date
        return ClusterSnapshot(
            now=now,
            replicas=view,
            session=sess,
            seq=self._seq,
            sessions_active=self._n_active,
            serving_since=self._serving_since,
            totals=self._totals,
            positions=self._pos,
        )

    # ---- hot path ----------------------------------------------------------------------------

    def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        now = self.clock.now()
        self._seq += 1
        if self._serving_since is None:
            self._serving_since = now
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
                        self._place(rep, now)
                    self._touch_active(rep, eff.session_id, now, s.context_tokens)
            elif isinstance(eff, SetOverflow):
                s = self._sessions.setdefault(eff.session_id, _Session(last_seen=now))
                s.overflow = tuple(r for r in eff.replicas if r != s.home)
        rep = self._replicas.get(target)
        if rep is None:
            raise ReplicaNotFoundError(target)
        rep.in_flight += 1
        self._dirty(rep)
        prev_ctx = 0
        if sess is not None and sid is not None:
            sess.in_flight[target] = sess.in_flight.get(target, 0) + 1
            sess.last_seen = now
            self._sessions.move_to_end(sid)
            prev_ctx = sess.context_tokens
            if request.chain_key is not None:
                sess.chains = remember_chain(sess.chains, request.chain_key, target)
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
        self._lease_rep[lease.lease_id] = rep
        return lease

    def release(self, lease: Lease, completion: Completion) -> None:
        if self._leases.pop(lease.lease_id, None) is None:
            return  # double release is a no-op: load must never go negative
        counted = self._lease_rep.pop(lease.lease_id, None)
        now = self.clock.now()
        rep = self._replicas.get(lease.replica_id)
        if rep is not counted:
            rep = None  # removed (and maybe registered again) since: its count left with it
        s = self._sessions.get(lease.session_id) if lease.session_id is not None else None
        if rep is not None and s is not None and s.home == lease.replica_id and s.residency_mark > 0:
            found = residency_feedback(lease, completion)
            if found is not None:
                since = rep.tokens_written - s.residency_mark
                hbm, host = capacities(rep.spec, rep.engine)
                rep.horizon = learn_horizon(rep.horizon, since, found, hbm + host if hbm else 0)
        if rep is not None:
            rep.in_flight = max(0, rep.in_flight - 1)
            if completion.prompt_tokens is not None:
                new = completion.prompt_tokens - (completion.cached_tokens or 0)
                rep.tokens_written += max(0, new) + (completion.completion_tokens or 0)
            self._dirty(rep)
        if lease.session_id is None or s is None:
            return
        n = s.in_flight.get(lease.replica_id, 0) - 1
        if n > 0:
            s.in_flight[lease.replica_id] = n
        else:
            s.in_flight.pop(lease.replica_id, None)
        s.last_seen = now
        self._sessions.move_to_end(lease.session_id)
        if completion.ok and completion.prompt_tokens is not None:
            ctx = completion.prompt_tokens + (completion.completion_tokens or 0) // max(1, completion.samples)
            if lease.replica_id == s.home:
                if ctx >= s.context_tokens or now - s.context_at > self.config.active_window_s:
                    # a smaller context (a sub-agent's, or the main chain after a compaction) replaces
                    # the session's only once its larger one has not been seen for a whole window
                    s.context_tokens, s.context_at = ctx, now
                s.turns += 1
                if completion.prompt_tokens > 0 and completion.prompt_bytes > 0:
                    s.bytes_per_token = completion.prompt_bytes / completion.prompt_tokens
                if rep is not None:
                    s.residency_mark = rep.tokens_written
        if s.home is not None and (home := self._replicas.get(s.home)) is not None:
            self._touch_active(home, lease.session_id, now, s.context_tokens)

    def leases(self) -> tuple[Lease, ...]:
        return tuple(self._leases.values())

    # ---- pins (engine sessions, stored responses) ----------------------------------------------------

    def pin(self, kind: PinKind, name: str, replica_id: ReplicaId) -> None:
        self.pins.pin(kind, name, replica_id)

    def pinned(self, kind: PinKind, name: str) -> ReplicaId | None:
        return self.pins.get(kind, name)

    def reserve(self, kind: PinKind, name: str, replica_id: ReplicaId) -> bool:
        return self.pins.reserve(kind, name, replica_id)

    def unpin(self, kind: PinKind, name: str) -> None:
        self.pins.unpin(kind, name)

    def share_config(self, doc: str) -> int:
        self.config_doc = (self.config_doc[0] + 1, doc)
        return self.config_doc[0]

    def shared_config(self, known: int) -> tuple[int, str | None]:
        gen, doc = self.config_doc
        return (gen, None) if gen == known else (gen, doc)


class MemoryStore:
    """Async ``StateStore`` over a ``MemoryCore`` (one process; nothing to start)."""

    # none of the methods ever suspends: the gateway needs no ``asyncio.shield`` (a task per
    # request) around ``release`` to protect it from a second cancellation
    never_suspends = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "never_suspends" not in cls.__dict__:
            cls.never_suspends = False  # a subclass may await: it must opt in explicitly

    def __init__(self, clock: Clock, config: StoreConfig | None = None) -> None:
        self.core = MemoryCore(clock, config)

    @property
    def residency(self) -> ResidencyView | None:
        return self.core.residency

    @residency.setter
    def residency(self, view: ResidencyView | None) -> None:
        self.core.residency = view

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

    async def report_health(self, stamps: Mapping[ReplicaId, HealthStamp]) -> None:
        self.core.report_health(stamps)

    async def health_stamps(self) -> Mapping[ReplicaId, HealthStamp]:
        return dict(self.core.health)

    async def probers(self) -> tuple[str, ...]:
        return ()  # one memory store, one gateway

    async def replicas(self) -> tuple[ReplicaState, ...]:
        return self.core.replicas()

    async def session(self, session_id: str) -> SessionState | None:
        return self.core.session(session_id)

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        return self.core.sessions_on(replica_id, limit)

    async def pin(self, kind: PinKind, name: str, replica_id: ReplicaId) -> None:
        self.core.pin(kind, name, replica_id)

    async def pinned(self, kind: PinKind, name: str) -> ReplicaId | None:
        return self.core.pinned(kind, name)

    async def reserve(self, kind: PinKind, name: str, replica_id: ReplicaId) -> bool:
        return self.core.reserve(kind, name, replica_id)

    async def unpin(self, kind: PinKind, name: str) -> None:
        self.core.unpin(kind, name)

    async def share_config(self, doc: str) -> int:
        return self.core.share_config(doc)

    async def shared_config(self, known: int) -> tuple[int, str | None]:
        return self.core.shared_config(known)

    async def close(self) -> None:
        return None
