"""The Redis store's fast path: a local replica table and session cache, so that a request of a
session this gateway has seen costs two round trips (acquire + release) instead of three.

Rules:
  1. The replica table is a copy refreshed by a background task every ``refresh_s`` (others'
     in-flight, engine load, windows), composed at each snapshot with this gateway's own exact
     in-flight (``OwnLeases``) and its own placements and tokens written since the copy was taken
     (``deltas``, dropped once a refresh that saw them arrives).
  1b. A large table is read in parts: every refresh brings every replica's in-flight (what changes
     with each request), but the rest of the rows (engine figures, windows, status) of only one
     part of ``rows_per_refresh`` replicas, in turn. A whole read of 1,000 replicas costs Redis's one
     thread ~7 ms: at 20 reads a second each gateway took 15 % of it (docs/REDIS.md, "Fleets of
     1,000 replicas"). A change of membership, a table too old or a registry write of ours reads the
     whole table.
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
    FleetTotals,
    Lease,
    ReplicaId,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    SessionState,
    fleet_totals,
)
from router.store.base import StoreConfig
from router.store.memory import PLACEMENT_REASONS
from router.store.redis._fallback import Fallback
from router.store.redis._leases import OwnLeases
from router.store.redis._wire import RedisWire

__all__ = ["FastPath", "merge_inflight"]

_SESSION_CACHE_MAX = 50_000
ROWS_PER_REFRESH = 100  # rule 1b: a table of up to this many replicas is read whole every refresh
# per replica since a refresh: placements, tokens written, sessions made active, their context
_PLACED, _WRITTEN, _SESSIONS, _CONTEXT = range(4)
_NO_DELTA = (0, 0, 0, 0)
_NO_ADJUSTMENT = (0, 0, 0, 0, 0)  # own in-flight, then the four deltas


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
        rows_per_refresh: int = ROWS_PER_REFRESH,
    ) -> None:
        if refresh_s < 0:
            raise ValueError(f"replica_refresh_s must be >= 0: {refresh_s}")
        self._wire = wire
        self._config = config
        self._gateway_id = gateway_id
        self._own = own
        self._fallback = fallback
        self.refresh_s = refresh_s
        self.rows_per_refresh = max(1, rows_per_refresh)
        self._part = 0  # the next part a partial refresh reads (rule 1b)
        # replicas, seq, active sessions, serving since
        self._table: tuple[tuple[ReplicaState, ...], int, int, float | None] | None = None
        self._table_at = 0.0  # event-loop time the table arrived
        self._index: dict[ReplicaId, int] = {}  # replica id -> its row in the table
        self._totals: FleetTotals | None = None  # fleet_totals of the table as read
        # the table with our own additions, as last composed (None: compose anew), what was added
        # to each row, and its totals
        self._comp: list[ReplicaState] | None = None
        self._comp_adj: dict[ReplicaId, tuple[int, int, int, int, int]] = {}
        self._comp_totals: FleetTotals | None = None
        self._sent = 0  # refresh generations
        self._applied = 0
        self._dirty = 0  # bumped by this gateway's registry writes: the table must be re-read
        self._clean = 0
        self.seq_local = 0  # our acquires since the table's seq
        self._deltas: list[dict[ReplicaId, list[int]]] = [{}]
        self.cache: OrderedDict[str, SessionState] = OrderedDict()  # others' in-flight only
        self._refreshing: asyncio.Future[SessionState | None] | None = None
        self.refresh_total = 0
        self.partial_refresh_total = 0
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
        return self._table is None or self._clean != self._dirty or self._stale_age()

    def _stale_age(self) -> bool:
        age = asyncio.get_running_loop().time() - self._table_at
        return age > max(0.5, 10 * self.refresh_s)  # the refresher is starved or failing

    def _parts(self) -> int:
        """How many parts the next refresh reads the table in (1: whole; rule 1b)."""
        if self._table is None or self._clean != self._dirty or self._stale_age():
            return 1
        n = len(self._table[0])
        return max(1, -(-n // self.rows_per_refresh))

    async def refresh(self, session_key: str | None, *, whole: bool = False) -> SessionState | None:
        """One snapshot round trip: the replica table without our own in-flight (we add it exactly),
        whole or in part (rule 1b), plus one session (``None``: none)."""
        parts = 1 if whole else self._parts()
        part = self._part % parts
        self._sent += 1
        gen, dirty = self._sent, self._dirty
        cut: dict[ReplicaId, list[int]] = {}
        self._deltas.append(cut)  # deltas recorded from here on may not be in this reply
        c = self._config
        args: list[str | int | float] = [self._wire.now(), c.active_window_s, c.ramp_window_s, c.session_ttl_s,
                                         session_key or "", self._gateway_id]  # fmt: skip
        if parts > 1:
            args += [part, parts]
        reply = await self._wire.eval("snapshot", args, "refresh")
        seq, rows, srow, active, t0 = reply[:5]
        self.refresh_total += 1
        fresh = tuple(self._wire.replica_state(r) for r in rows)
        if gen > self._applied:
            replicas: tuple[ReplicaState, ...] | None = fresh
            read: set[ReplicaId] | None = None  # the replicas whose rows this reply brings (None: all)
            if parts > 1:
                replicas, read = self._merged(fresh, reply[5], reply[6], part, parts)
            if replicas is None:
                # the fleet changed: read it whole now; ``cut`` stays, with what we noted meanwhile
                return await self.refresh(session_key, whole=True)
            if parts > 1:
                self.partial_refresh_total += 1
                self._part = part + 1
                active = sum(r.sessions_active for r in replicas)
            self._applied = gen
            self._table = (replicas, int(seq), int(active), self._wire.local(t0) if t0 else None)
            self._index = {r.id: i for i, r in enumerate(replicas)}
            self._totals = fleet_totals(replicas)
            self._comp = None
            self._table_at = asyncio.get_running_loop().time()
            self._clean = max(self._clean, dirty)
            self.seq_local = 0
            self._fallback.last_replicas = replicas
            self._drop_seen_deltas(cut, read)
        if session_key is None:
            return None
        self.cache_row(session_key, srow)
        return self.cache.get(session_key)

    def _merged(
        self, fresh: tuple[ReplicaState, ...], ids: list[Any], flat: list[Any], part: int, parts: int
    ) -> tuple[tuple[ReplicaState, ...] | None, set[ReplicaId]]:
        """The table with this part's rows replaced and everyone's in-flight set from ``flat``; None
        when the replicas are not those of the table (a row this reply lacks)."""
        assert self._table is not None
        table, index = self._table[0], self._index
        ids = [str(i) for i in ids]
        read = {rid for i, rid in enumerate(ids) if i % parts == part}
        if set(ids) - read != index.keys() - read:
            return None, read
        inflight = {str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        rows = {r.id: r for r in fresh}  # a replica of this part without a row expired: it is gone
        out = []
        for rid in ids:
            r = rows.get(rid) if rid in read else table[index[rid]]
            if r is None:
                continue
            n = inflight.get(rid, 0)
            out.append(r if r.in_flight == n else replace(r, in_flight=n))
        return tuple(out), read

    def _drop_seen_deltas(self, cut: dict[ReplicaId, list[int]], read: set[ReplicaId] | None) -> None:
        """Our deltas recorded before ``cut`` are in the rows this reply brought (``read``; None: all)."""
        i = next(i for i, bucket in enumerate(self._deltas) if bucket is cut)
        if read is None:
            del self._deltas[:i]
            return
        for bucket in self._deltas[:i]:
            for rid in read.intersection(bucket):
                del bucket[rid]
        while len(self._deltas) > 1 and not self._deltas[0] and self._deltas[0] is not cut:
            del self._deltas[0]

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

    def _composed(self) -> tuple[tuple[ReplicaState, ...], FleetTotals]:
        """The table with our own in-flight and deltas added, and its totals. The composed rows are
        kept between snapshots: only a row whose additions changed since the last one is rebuilt
        and the totals adjusted by it, so a request's snapshot costs what our own load changed,
        not a scan of the fleet (1,000 replicas)."""
        assert self._table is not None and self._totals is not None
        table = self._table[0]
        if self._comp is None:  # a new table: nothing of ours is on it yet
            self._comp, self._comp_adj, self._comp_totals = list(table), {}, self._totals
        adds: dict[ReplicaId, list[int]] = {}
        for bucket in self._deltas:
            for rid, d in bucket.items():
                a = adds.get(rid)
                if a is None:
                    adds[rid] = list(d)
                else:
                    for k in range(4):
                        a[k] += d[k]
        own_rep = self._own.per_replica
        comp, applied, t = self._comp, self._comp_adj, self._comp_totals
        assert t is not None
        for rid in adds.keys() | own_rep.keys() | applied.keys():
            want = (own_rep.get(rid, 0), *adds.get(rid, _NO_DELTA))
            had = applied.get(rid, _NO_ADJUSTMENT)
            if want == had:
                continue
            i = self._index.get(rid)
            if i is None:
                continue
            r = table[i]
            own, placed, tw, sess, ctx = want
            comp[i] = replace(
                r,
                in_flight=r.in_flight + own,
                placed_recent=r.placed_recent + placed,
                tokens_written=r.tokens_written + tw,
                sessions_active=r.sessions_active + sess,
                active_context_tokens=r.active_context_tokens + ctx,
            )
            if r.status is ReplicaStatus.ACTIVE:
                t = replace(
                    t,
                    active_in_flight=t.active_in_flight + own - had[0],
                    active_sessions=t.active_sessions + sess - had[3],
                    active_placed_recent=t.active_placed_recent + placed - had[1],
                )
            if any(want):
                applied[rid] = want
            else:
                del applied[rid]
        self._comp_totals = t
        return tuple(comp), t

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
        replicas, totals = self._composed()
        return ClusterSnapshot(
            now=now,
            replicas=replicas,
            totals=totals,
            session=self._with_own(session) if session is not None else None,
            seq=seq + self.seq_local,
            sessions_active=active,
            serving_since=since,
        )
