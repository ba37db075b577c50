"""The Redis store's fast path: a local replica table and session cache, so that a request of a
session this gateway has seen costs two round trips (acquire + release) instead of three.

Rules:
  1. The replica table is a copy refreshed by a background task every ``refresh_s`` (others'
     in-flight, engine load, windows), composed at each snapshot with this gateway's own exact
     in-flight (``OwnLeases``) and its own placements and tokens written since the copy was taken
     (``deltas``, dropped once a refresh that saw them arrives).
  2. A table older than ``max(0.5, 10 * refresh_s)`` or older than a registry write of ours
     (``mark_dirty``) is refreshed before use; concurrent snapshots share one refresh.
  3. Sessions come from a bounded cache fed by the acquire and release replies; a session idle past
     its TTL, or unknown, is read from Redis (a cache miss).
  4. ``acquire`` is optimistic: the script gets the home the decision assumed; if another gateway
     moved the session meanwhile, the request follows the real home (``disagreement``) when it is
     active, else nothing is applied and ``StaleSessionError`` is raised, with the real state cached
     so that routing again decides on it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from router.model import (
    BindSession,
    ClusterSnapshot,
    Lease,
    ReplicaId,
    ReplicaState,
    RouteDecision,
    SessionState,
)
from router.store.base import StoreConfig
from router.store.memory import PLACEMENT_REASONS
from router.store.redis._fallback import Fallback
from router.store.redis._leases import OwnLeases
from router.store.redis._wire import RedisWire

__all__ = ["FastPath", "merge_inflight"]

_SESSION_CACHE_MAX = 50_000
# per replica since a refresh: placements, tokens written, sessions made active, their context
_PLACED, _WRITTEN, _SESSIONS, _CONTEXT = range(4)


def merge_inflight(
    others: tuple[tuple[ReplicaId, int], ...], own: dict[ReplicaId, int] | None
) -> tuple[tuple[ReplicaId, int], ...]:
    if not own:
        return others
    d = dict(others)
    for rid, n in own.items():
        d[rid] = d.get(rid, 0) + n
    return tuple(sorted((rid, n) for rid, n in d.items() if n > 0))


class FastPath:
    def __init__(
        self,
        wire: RedisWire,
        config: StoreConfig,
        gateway_id: str,
        own: OwnLeases,
        fallback: Fallback,
        refresh_s: float,
    ) -> None:
        if refresh_s < 0:
            raise ValueError(f"replica_refresh_s must be >= 0: {refresh_s}")
        self._wire = wire
        self._config = config
        self._gateway_id = gateway_id
        self._own = own
        self._fallback = fallback
        self.refresh_s = refresh_s
        # replicas, seq, active sessions, serving since
        self._table: tuple[tuple[ReplicaState, ...], int, int, float | None] | None = None
        self._table_at = 0.0  # event-loop time the table arrived
        self._sent = 0  # refresh generations
        self._applied = 0
        self._dirty = 0  # bumped by this gateway's registry writes: the table must be re-read
        self._clean = 0
        self.seq_local = 0  # our acquires since the table's seq
        self._deltas: list[dict[ReplicaId, list[int]]] = [{}]
        self.cache: OrderedDict[str, SessionState] = OrderedDict()  # others' in-flight only
        self._refreshing: asyncio.Future[SessionState | None] | None = None
        self.refresh_total = 0
        self.session_cache_misses = 0
        self.stale_total = 0

    @property
    def on(self) -> bool:
        return self.refresh_s > 0

    def mark_dirty(self) -> None:
        self._dirty += 1

    def forget(self) -> None:
        """After a resync: sessions may have moved meanwhile; re-read everything."""
        self._table = None
        self.cache.clear()

    # ---- the session cache (rule 3) ------------------------------------------------------------------

    def cache_row(self, sid: str, row: Any) -> None:
        if isinstance(row, list) and row:
            s = self._wire.session_state(row)
            self.cache[sid] = s
            self.cache.move_to_end(sid)
            if len(self.cache) > _SESSION_CACHE_MAX:
                self.cache.popitem(last=False)
            if s.home is not None:
                self._fallback.remember(s)
        else:
            self.cache.pop(sid, None)

    def cached_home(self, sid: str | None) -> str:
        cached = self.cache.get(sid) if sid is not None else None
        return (cached.home or "") if cached is not None else ""

    def _with_own(self, s: SessionState) -> SessionState:
        own = self._own.per_session.get(s.session_id)
        return replace(s, in_flight=merge_inflight(s.in_flight, own)) if own else s

    # ---- deltas (rule 1) -----------------------------------------------------------------------------

    def _delta(self, rid: ReplicaId) -> list[int]:
        bucket = self._deltas[-1]
        d = bucket.get(rid)
        if d is None:
            d = bucket[rid] = [0, 0, 0, 0]
        return d

    def note_written(self, rid: ReplicaId, tokens: int) -> None:
        self._delta(rid)[_WRITTEN] += tokens

    def note_binds(self, decision: RouteDecision, lease: Lease) -> None:
        """Our own placements count on our table at once (others' arrive with the next refresh)."""
        if lease.disagreement:
            return
        for eff in decision.effects:
            if isinstance(eff, BindSession) and eff.replica_id == lease.replica_id:
                d = self._delta(eff.replica_id)
                if eff.reason in PLACEMENT_REASONS:
                    d[_PLACED] += 1
                d[_SESSIONS] += 1
                d[_CONTEXT] += lease.prev_context_tokens

    # ---- the replica table (rules 1-2) ---------------------------------------------------------------

    def _stale(self) -> bool:
        if self._table is None or self._clean != self._dirty:
            return True
        age = asyncio.get_running_loop().time() - self._table_at
        return age > max(0.5, 10 * self.refresh_s)  # the refresher is starved or failing

    async def refresh(self, session_key: str | None) -> SessionState | None:
        """One full snapshot round trip: the replica table without our own in-flight (we add it
        exactly), plus one session (``None``: none)."""
        self._sent += 1
        gen, dirty = self._sent, self._dirty
        cut: dict[ReplicaId, list[int]] = {}
        self._deltas.append(cut)  # deltas recorded from here on may not be in this reply
        c = self._config
        seq, rows, srow, active, t0 = await self._wire.eval(
            "snapshot",
            [self._wire.now(), c.active_window_s, c.ramp_window_s, c.session_ttl_s, session_key or "",
             self._gateway_id],
            "refresh",
        )  # fmt: skip
        self.refresh_total += 1
        replicas = tuple(self._wire.replica_state(r) for r in rows)
        if gen > self._applied:
            self._applied = gen
            self._table = (replicas, int(seq), int(active), self._wire.local(t0) if t0 else None)
            self._table_at = asyncio.get_running_loop().time()
            self._clean = max(self._clean, dirty)
            self.seq_local = 0
            self._fallback.last_replicas = replicas
            for i, bucket in enumerate(self._deltas):
                if bucket is cut:
                    del self._deltas[:i]
                    break
        if session_key is None:
            return None
        self.cache_row(session_key, srow)
        return self.cache.get(session_key)

    async def _shared_refresh(self) -> None:
        """Single flight: concurrent snapshots that find the table stale wait for one refresh."""
        fut = self._refreshing
        if fut is None:
            fut = self._refreshing = asyncio.ensure_future(self.refresh(None))

            def done(f: asyncio.Future[SessionState | None]) -> None:
                if self._refreshing is f:
                    self._refreshing = None
                if not f.cancelled():
                    f.exception()  # retrieved: every waiter gets it, none may be left

            fut.add_done_callback(done)
        await asyncio.shield(fut)

    def _composed_replicas(self) -> tuple[ReplicaState, ...]:
        assert self._table is not None
        own_rep = self._own.per_replica
        out = []
        for r in self._table[0]:
            own = own_rep.get(r.id, 0)
            placed = tw = sess = ctx = 0
            for bucket in self._deltas:
                d = bucket.get(r.id)
                if d is not None:
                    placed, tw, sess, ctx = placed + d[0], tw + d[1], sess + d[2], ctx + d[3]
            if own or placed or tw or sess or ctx:
                r = replace(
                    r,
                    in_flight=r.in_flight + own,
                    placed_recent=r.placed_recent + placed,
                    tokens_written=r.tokens_written + tw,
                    sessions_active=r.sessions_active + sess,
                    active_context_tokens=r.active_context_tokens + ctx,
                )
            out.append(r)
        return tuple(out)

    async def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self._wire.clock.now()
        session: SessionState | None = None
        if self._stale():
            await self._shared_refresh()
        if session_key is not None:
            session = self.cache.get(session_key)
            if session is not None and session.last_seen < now - self._config.session_ttl_s:
                session = None  # idle past its TTL: ask Redis (it forgets it, or another gateway kept it)
            if session is None:
                self.session_cache_misses += 1
                row = await self._wire.eval(
                    "sessions",
                    ["one", self._wire.fleet(now), self._config.session_ttl_s, session_key, 0, self._gateway_id],
                    "session",
                )
                self.cache_row(session_key, row)
                session = self.cache.get(session_key)
            else:
                self.cache.move_to_end(session_key)
        assert self._table is not None
        _, seq, active, since = self._table
        return ClusterSnapshot(
            now=now,
            replicas=self._composed_replicas(),
            session=self._with_own(session) if session is not None else None,
            seq=seq + self.seq_local,
            sessions_active=active,
            serving_since=since,
        )
