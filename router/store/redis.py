"""Redis state store: many gateways, one truth. Same semantics as ``MemoryCore`` (the reference).

Rules:
  1. Every state change is one Lua script (``lua/*.lua``), so it is atomic and costs one round trip:
     snapshot (1) + acquire (1) + release (1) per request (rule 6: acquire + release). Never
     read-then-write from Python.
  2. Every key carries the hash tag ``{prefix}`` (``keys.py``): one slot, so the scripts work on a
     single Redis and on Redis Cluster alike.
  3. Times stored in Redis are *fleet* seconds: the injected clock plus a fixed offset to the epoch
     (``time.time() - clock.now()`` at start, or ``epoch_offset_s``), so gateways on different hosts
     agree, and a ``VirtualClock`` still drives every TTL and window in tests. Gateway leases alone
     use Redis's own ``TIME`` (a dead gateway cannot vouch for itself).
  4. In-flight counts live per gateway under a lease refreshed by a heartbeat task every
     ``lease_ttl_s / 3``; readers only sum live gateways, so a SIGKILLed gateway's load vanishes once
     its lease expires, and the next heartbeat of any gateway deletes it.
  5. Redis failures never reach the caller (``map_redis_errors`` is the one boundary). On an error or
     a timeout the store turns *degraded*: it serves from a local ``MemoryCore`` mirror (replicas last
     seen + registry writes since; sessions last seen keep their home; new ones are placed by the
     policy, whose rendezvous tie-break agrees across gateways), probes Redis with backoff, and on
     return restores its in-flight counts exactly, replays registry writes and republishes the
     bindings it made meanwhile with compare-and-set.
  6. Fast path (``replica_refresh_s > 0``: the gateway's default via ``make_redis_store``, off in the
     constructor): 2 round trips per request of a session
     this gateway has seen (acquire + release), 3 for a session new to it. The replica table is a
     local copy refreshed by a background task every ``replica_refresh_s`` (others' in-flight,
     engine load, windows), plus this gateway's own exact in-flight and its own placements and
     tokens written since the copy was taken; sessions come from a bounded local cache fed by the
     acquire and release replies. ``acquire`` is optimistic: the script gets the home the decision
     assumed; if another gateway moved the session meanwhile, the request follows the real home
     (``disagreement=True``) when it is active, else nothing is applied and ``StaleSession`` (a
     ``KeyError``: the gateway's retry path re-routes on a refreshed view) is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, replace
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from router.clock import Clock, SystemClock
from router.errors import ConfigError, StoreError
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
    capacities,
)
from router.residency import ResidencyView, snapshot_with_residency
from router.store.base import PLAUSIBLE_EVICTION, StaleSessionError, StoreConfig, residency_feedback
from router.store.keys import KeySpace
from router.store.memory import PLACEMENT_REASONS, MemoryCore

__all__ = [
    "GATEWAY_REPLICA_REFRESH_S",
    "RedisStore",
    "StaleSession",
    "gateway_refresh_s",
    "make_redis_store",
    "map_redis_errors",
]

log = logging.getLogger("kvroute.store.redis")

T = TypeVar("T")
_SCRIPTS = ("acquire", "release", "snapshot", "sessions", "registry", "lease", "republish")
_SESSION_CACHE_MAX = 50_000


class StaleSession(StaleSessionError):
    """Fast path: the session's real home differs from the one the decision assumed and is not usable
    (another gateway moved it meanwhile). Nothing was applied; the local view now holds the real state,
    so routing again decides on it."""


def _merge_inflight(
    others: tuple[tuple[ReplicaId, int], ...], own: dict[ReplicaId, int] | None
) -> tuple[tuple[ReplicaId, int], ...]:
    if not own:
        return others
    d = dict(others)
    for rid, n in own.items():
        d[rid] = d.get(rid, 0) + n
    return tuple(sorted((rid, n) for rid, n in d.items() if n > 0))


def _load_scripts() -> dict[str, str]:
    lua = resources.files("router.store").joinpath("lua")
    # constants shared with the memory store are defined once, in Python
    consts = f"local PLAUSIBLE_EVICTION = {PLAUSIBLE_EVICTION!r}\n"
    prelude = consts + lua.joinpath("_lib.lua").read_text()
    return {name: prelude + "\n" + lua.joinpath(f"{name}.lua").read_text() for name in _SCRIPTS}


@contextlib.asynccontextmanager
async def map_redis_errors(op: str) -> AsyncIterator[None]:
    """The one boundary where redis-py's (and the timeout's) exceptions become ``StoreError``."""
    try:
        yield
    except (rexc.RedisError, OSError, TimeoutError) as exc:
        raise StoreError(f"redis {op}: {type(exc).__name__}: {exc}") from exc


def _f(x: float) -> str:
    return repr(float(x))


def _spec_json(spec: ReplicaSpec) -> str:
    return json.dumps(asdict(spec), separators=(",", ":"), sort_keys=True)


def _split_cluster_flag(url: str) -> tuple[str, bool]:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flag = any(k == "cluster" and v.lower() in {"1", "true", "yes"} for k, v in query)
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return urlunsplit(parts._replace(query=rest)), flag


class RedisStore:
    """``StateStore`` over Redis (single node or Cluster). One instance per gateway process.

    Attributes for metrics: ``degraded`` (serving from local state now), ``degraded_total``
    (times it entered degraded mode), ``fallback_total`` (operations served locally because Redis
    failed or was away), ``resync_total``, ``last_error``, ``round_trips_total``.
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        gateway_id: str | None = None,
        config: StoreConfig | None = None,
        clock: Clock | None = None,
        *,
        epoch_offset_s: float | None = None,
        op_timeout_s: float = 0.5,
        retry_min_s: float = 0.05,
        retry_max_s: float = 2.0,
        replica_refresh_s: float = 0.0,
    ) -> None:
        self.client = client
        self.gateway_id = gateway_id or f"{socket.gethostname()[:24]}-{secrets.token_hex(4)}"
        if "|" in self.gateway_id:
            raise ValueError(f"gateway id must not contain '|': {self.gateway_id!r}")
        self.config = config or StoreConfig()
        self.clock = clock or SystemClock()
        self.keys = KeySpace(self.config.key_prefix)
        self.residency: ResidencyView | None = None  # fills SessionState.resident_* (router/residency.py)
        self._offset = time.time() - self.clock.now() if epoch_offset_s is None else epoch_offset_s
        self.op_timeout_s = op_timeout_s
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self._scripts = {name: client.register_script(src) for name, src in _load_scripts().items()}
        self._lease_ms = max(1, int(self.config.lease_ttl_s * 1000))
        self._session_ttl_ms = max(1, int(self.config.session_ttl_s * 1000))
        self._lease_seq = 0
        self._leases: dict[str, Lease] = {}  # outstanding leases counted in Redis (our truth)
        self._local_leases: dict[str, MemoryCore] = {}  # leases served by a mirror while degraded
        self._local_inner: dict[str, Lease] = {}
        self._suspects: set[str] = set()  # sessions whose acquire may or may not have landed
        self._spec_cache: dict[str, ReplicaSpec] = {}
        self._registered: dict[str, tuple[ReplicaSpec, ReplicaStatus]] = {}  # our own registry writes
        self._engine_cache: dict[str, EngineLoad] = {}
        self._last_replicas: tuple[ReplicaState, ...] = ()
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()  # last seen homes (for outages)
        self._pending_registry: list[Callable[[], Awaitable[None]]] = []
        self._degraded_binds: dict[str, tuple[ReplicaId, ReplicaId | None, int]] = {}
        self._mirror: MemoryCore | None = None
        self._writes = 0  # hot-path writes in progress (a restore waits for them)
        self._writes_idle = asyncio.Event()
        self._writes_idle.set()
        self._gate = asyncio.Event()  # cleared while a restore runs: new writes wait
        self._gate.set()
        self._need_restore = True  # first heartbeat publishes our (empty) state and our lease
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.degraded = False
        self.degraded_total = 0
        self.fallback_total = 0
        self.resync_total = 0
        self.round_trips_total = 0
        self.last_error: str | None = None
        # exact in-flight of this gateway (mirrors ``_leases``)
        self._own_rep: dict[ReplicaId, int] = {}
        self._own_sess: dict[str, dict[ReplicaId, int]] = {}
        # fast path (see rule 6)
        if replica_refresh_s < 0:
            raise ValueError(f"replica_refresh_s must be >= 0: {replica_refresh_s}")
        self.replica_refresh_s = replica_refresh_s
        # replicas, seq, active sessions, serving since
        self._table: tuple[tuple[ReplicaState, ...], int, int, float | None] | None = None
        self._table_at = 0.0  # event-loop time the table arrived
        self._table_sent = 0  # refresh generations
        self._table_applied = 0
        self._dirty = 0  # bumped by this gateway's registry writes: the table must be re-read
        self._clean = 0
        self._seq_local = 0  # our acquires since the table's seq
        self._deltas: list[dict[ReplicaId, list[int]]] = [{}]  # since a refresh: placed, tw, sessions, ctx
        self._cache: OrderedDict[str, SessionState] = OrderedDict()  # others' in-flight only
        self._refresher: asyncio.Task[None] | None = None
        self._refreshing: asyncio.Future[SessionState | None] | None = None
        self.refresh_total = 0
        self.session_cache_misses = 0
        self.stale_total = 0

    @property
    def fast(self) -> bool:
        return self.replica_refresh_s > 0

    # ---- construction ---------------------------------------------------------------------------

    @classmethod
    def from_url(
        cls,
        url: str,
        gateway_id: str | None = None,
        config: StoreConfig | None = None,
        clock: Clock | None = None,
        **kwargs: Any,
    ) -> RedisStore:
        """``redis://[user:pass@]host:port/db``, ``rediss://`` (TLS; ``ssl_cert_reqs`` etc. as query
        parameters, per redis-py), ``unix://``; add ``?cluster=1`` for Redis Cluster."""
        op_timeout_s = float(kwargs.get("op_timeout_s", 0.5))
        plain, cluster = _split_cluster_flag(url)
        common: dict[str, Any] = {
            "decode_responses": True,
            "socket_timeout": max(op_timeout_s, 0.05),
            "socket_connect_timeout": max(op_timeout_s, 0.05),
            "retry": Retry(NoBackoff(), 0),  # we retry (and degrade) ourselves, never block a request
        }
        client: aioredis.Redis | RedisCluster
        if cluster:
            client = RedisCluster.from_url(plain, **common)
        else:
            # a blocking pool: a burst beyond 256 concurrent calls waits (within the op timeout)
            # instead of failing with "Too many connections"
            pool = aioredis.BlockingConnectionPool.from_url(
                plain, max_connections=256, timeout=op_timeout_s, **common
            )
            client = aioredis.Redis.from_pool(pool)  # closes the pool with the client
        return cls(client, gateway_id, config, clock, **kwargs)

    # ---- time ------------------------------------------------------------------------------------

    def _fleet(self, t_local: float) -> str:
        return _f(t_local + self._offset)

    def _local(self, t_fleet: str | float) -> float:
        v = float(t_fleet)
        return 0.0 if v == 0.0 else v - self._offset

    # ---- plumbing --------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._keeper(), name="kvroute-redis-keeper")
        if self.fast and self._refresher is None and not self._closed:
            self._refresher = asyncio.get_running_loop().create_task(
                self._refresh_loop(), name="kvroute-redis-refresh"
            )

    async def start(self) -> None:
        """Optional: publish the lease now (otherwise the first call does it in the background)."""
        self._ensure_started()
        if not self.degraded:
            with contextlib.suppress(StoreError):
                await self._restore()

    async def _eval(self, name: str, args: list[str | int | float], op: str | None = None) -> Any:
        self.round_trips_total += 1
        async with map_redis_errors(op or name):
            async with asyncio.timeout(self.op_timeout_s):
                return await self._scripts[name](keys=[self.keys.seq], args=[self.keys.base, *args])

    @contextlib.asynccontextmanager
    async def _hot_write(self) -> AsyncIterator[None]:
        if not self._gate.is_set():
            async with map_redis_errors("wait for restore"):
                async with asyncio.timeout(self.op_timeout_s):
                    await self._gate.wait()
        self._writes += 1
        self._writes_idle.clear()
        try:
            yield
        finally:
            self._writes -= 1
            if self._writes == 0:
                self._writes_idle.set()

    def _fail(self, exc: BaseException) -> None:
        self.last_error = str(exc)
        self._need_restore = True  # a write may or may not have landed: restore our exact counts
        if not self.degraded:
            self.degraded = True
            self.degraded_total += 1
            self._mirror = self._build_mirror()
            log.warning("redis unavailable, serving from local state: %s", exc)
        self._wake.set()

    def _build_mirror(self) -> MemoryCore:
        """Local state to serve from while Redis is away: the replicas of the last snapshot plus
        those this process registered itself since."""
        core = MemoryCore(self.clock, self.config)
        seen = set()
        for r in self._last_replicas:
            spec = self._spec_cache.get(r.id) or ReplicaSpec(id=r.id, url=r.url, model=r.model)
            core.upsert_replica(spec, r.status)
            core.report_engine_load(r.id, r.engine)
            seen.add(r.id)
        for rid, (spec, status) in self._registered.items():
            if rid not in seen:
                core.upsert_replica(spec, status)
        return core

    # ---- background: heartbeat, probe, resync ----------------------------------------------------

    async def _keeper(self) -> None:
        backoff = self.retry_min_s
        interval = max(0.05, self.config.lease_ttl_s / 3)
        me = asyncio.current_task()
        while not self._closed and not (me is not None and me.cancelling()):
            try:
                if self.degraded:
                    try:
                        await self._resync()
                    except StoreError as exc:
                        self.last_error = str(exc)
                        await self._sleep(backoff)
                        backoff = min(self.retry_max_s, backoff * 2)
                        continue
                    backoff = self.retry_min_s
                    continue  # a lease released during the resync may already ask for a restore
                elif self._need_restore:
                    await self._restore()
                else:
                    lost, _dead = await self._eval("lease", ["beat", self.gateway_id, self._lease_ms])
                    if int(lost):
                        self._need_restore = True
                        continue
                await self._sleep(interval)
            except StoreError as exc:
                self._fail(exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not kill the heartbeat: log it and go on
                log.exception("redis keeper iteration failed")
                await self._sleep(interval)

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _restore(self) -> None:
        """Set our in-flight hash and session fields in Redis to exactly our outstanding leases."""
        self._gate.clear()
        try:
            async with asyncio.timeout(self.op_timeout_s * 4):
                await self._writes_idle.wait()
            per_rep: dict[str, int] = {}
            per_sess: dict[str, dict[str, int]] = {}
            for lease in self._leases.values():
                per_rep[lease.replica_id] = per_rep.get(lease.replica_id, 0) + 1
                if lease.session_id is not None:
                    d = per_sess.setdefault(lease.session_id, {})
                    d[lease.replica_id] = d.get(lease.replica_id, 0) + 1
            for sid in self._suspects:
                per_sess.setdefault(sid, {})
            args: list[str | int | float] = ["restore", self.gateway_id, self._lease_ms, len(per_rep)]
            for rid, n in per_rep.items():
                args += [rid, n]
            args.append(len(per_sess))
            for sid, d in per_sess.items():
                args += [sid, len(d)]
                for rid, n in d.items():
                    args += [rid, n]
            await self._eval("lease", args, "restore")
            self._suspects.clear()
            self._need_restore = False
        except TimeoutError as exc:
            raise StoreError("redis restore: hot-path writes did not drain") from exc
        finally:
            self._gate.set()

    async def _resync(self) -> None:
        """Redis is back (or we try): republish what an empty Redis lost, replay registry writes,
        republish bindings made meanwhile, then restore our exact in-flight counts."""
        # Idle pooled connections may lead to a Redis that died: each would fail once, one call at a
        # time, and every failure is another degrade/resync cycle (with backoff) before the counts
        # are exact again. Drop them all now.
        pool = getattr(self.client, "connection_pool", None)
        if pool is not None and not isinstance(self.client, RedisCluster):
            with contextlib.suppress(rexc.RedisError, OSError):
                await pool.disconnect(inuse_connections=False)
        await self._republish_if_wiped()
        while self._pending_registry:
            await self._pending_registry[0]()
            self._pending_registry.pop(0)
        if self._degraded_binds:
            items = list(self._degraded_binds.items())
            args: list[str | int | float] = [
                self._fleet(self.clock.now()),
                self.config.session_ttl_s,
                self._session_ttl_ms,
                len(items),
            ]
            for sid, (rid, only_if, ctx) in items:
                args += [sid, rid, only_if or "", ctx]
            homes = await self._eval("republish", args)
            for (sid, (rid, _, _)), home in zip(items, homes, strict=True):
                self._sessions.pop(sid, None)
                self._degraded_binds.pop(sid, None)
                if home != rid:
                    log.info("session %s was bound elsewhere meanwhile; %s wins", sid, home)
        # our in-flight counts last: the sessions they belong to exist again by now
        await self._restore()
        # a last snapshot refreshes what the mirror would start from next time
        await self._redis_snapshot(None)
        self._table = None  # re-read at the next snapshot; sessions may have moved meanwhile
        self._cache.clear()
        self.degraded = False
        self._mirror = None
        self.resync_total += 1
        log.warning("redis is back: state resynchronised")

    async def _republish_if_wiped(self) -> None:
        """A Redis that came back empty (restarted without persistence) gets our view back: the
        replicas our mirror knows and every session home we have seen, each with compare-and-set."""
        snap = await self._redis_snapshot(None)
        mirror = self._mirror
        if snap.replicas or mirror is None:
            return
        for r in mirror.replicas():
            spec = self._spec_cache.get(r.id) or ReplicaSpec(id=r.id, url=r.url, model=r.model)
            await self._registry("upsert", r.id, _spec_json(spec), r.status.value, self._expiry(spec.source))
            if r.engine.updated_at:
                await self._registry(
                    "engine", r.id, self._engine_json(r.engine), "", self._expiry(spec.source)
                )
        for sid, known in list(self._sessions.items()):
            if known.home is not None and sid not in self._degraded_binds:
                self._degraded_binds[sid] = (known.home, None, known.context_tokens)

    # ---- parsing ---------------------------------------------------------------------------------

    def _spec(self, rid: str, raw: str) -> ReplicaSpec:
        spec = self._spec_cache.get(raw)
        if spec is None:
            spec = ReplicaSpec(**json.loads(raw))
            if len(self._spec_cache) > 10_000:
                self._spec_cache.clear()
            self._spec_cache[raw] = spec
            self._spec_cache[rid] = spec
        return spec

    def _engine(self, raw: str) -> EngineLoad:
        if not raw:
            return EngineLoad()
        eng = self._engine_cache.get(raw)
        if eng is None:
            d = json.loads(raw)
            d["updated_at"] = self._local(d.get("updated_at", 0.0))
            eng = EngineLoad(**d)
            if len(self._engine_cache) > 10_000:
                self._engine_cache.clear()
            self._engine_cache[raw] = eng
        return eng

    def _replica_state(self, row: list[Any]) -> ReplicaState:
        rid, spec_raw, status, joined, engine_raw, tw, actctx, nact, nplc, inflight, horizon = row
        spec = self._spec(rid, spec_raw)
        engine = self._engine(engine_raw)
        cap, host = capacities(spec, engine)
        return ReplicaState(
            id=rid,
            url=spec.url,
            status=ReplicaStatus(status),
            joined_at=self._local(joined),
            in_flight=int(inflight),
            engine=engine,
            capacity_tokens=cap,
            host_capacity_tokens=host,
            sessions_active=int(nact),
            active_context_tokens=int(actctx),
            tokens_written=int(tw),
            placed_recent=int(nplc),
            model=spec.model,
            residency_horizon_tokens=int(horizon),
        )

    def _session_state(self, row: list[Any]) -> SessionState:
        sid, home, ovf, ctx, seen, mark, turns, pl, bpt = row
        per = sorted((str(pl[i]), int(pl[i + 1])) for i in range(0, len(pl), 2))
        return SessionState(
            session_id=sid,
            home=home or None,
            overflow=tuple(ovf.split(",")) if ovf else (),
            in_flight=tuple(per),
            context_tokens=int(ctx),
            last_seen=self._local(seen),
            residency_mark=int(mark),
            turns=int(turns),
            bytes_per_token=float(bpt),
        )

    def _remember(self, s: SessionState) -> None:
        self._sessions[s.session_id] = s
        self._sessions.move_to_end(s.session_id)
        if len(self._sessions) > _SESSION_CACHE_MAX:
            self._sessions.popitem(last=False)

    # ---- StateStore: hot path --------------------------------------------------------------------

    async def _redis_snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        c = self.config
        seq, rows, srow, active, t0 = await self._eval(
            "snapshot",
            [self._fleet(now), c.active_window_s, c.ramp_window_s, c.session_ttl_s, session_key or ""],
        )
        replicas = tuple(self._replica_state(r) for r in rows)
        self._last_replicas = replicas
        session = self._session_state(srow) if srow else None
        if session is not None and session.home is not None:
            self._remember(session)
        return ClusterSnapshot(
            now=now,
            replicas=replicas,
            session=session,
            seq=int(seq),
            sessions_active=int(active),
            serving_since=self._local(t0) if t0 else None,
        )

    async def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        snap = await self._snapshot(session_key)
        # exact residency (router/residency.py): from this gateway's subscribers or the Redis mirror
        return snap if self.residency is None else snapshot_with_residency(snap, self.residency)

    async def _snapshot(self, session_key: str | None) -> ClusterSnapshot:
        self._ensure_started()
        if not self.degraded:
            try:
                if self.fast:
                    return await self._fast_snapshot(session_key)
                return await self._redis_snapshot(session_key)
            except StoreError as exc:
                self._fail(exc)
        self.fallback_total += 1
        mirror = self._mirror_core()
        if session_key is not None:
            self._seed_mirror(mirror, session_key)
        return mirror.snapshot(session_key)

    def _mirror_core(self) -> MemoryCore:
        if self._mirror is None:
            self._mirror = self._build_mirror()
        return self._mirror

    def _seed_mirror(self, mirror: MemoryCore, sid: str) -> None:
        """Give the mirror a session's home as Redis last told us (public API only)."""
        known = self._sessions.get(sid)
        if known is None or known.home is None:
            return
        cur = mirror.session(sid)
        if cur is not None:
            return
        rep = {r.id for r in mirror.replicas()}
        if known.home not in rep:
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

    async def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        self._ensure_started()
        if not self.degraded:
            try:
                return await self._redis_acquire(decision, request)
            except StoreError as exc:
                if request.session_key is not None:
                    self._suspects.add(request.session_key)
                self._fail(exc)
        self.fallback_total += 1
        mirror = self._mirror_core()
        for eff in decision.effects:
            self._seed_mirror(mirror, eff.session_id)
            if isinstance(eff, BindSession):
                before = mirror.session(eff.session_id)
                self._degraded_binds.setdefault(
                    eff.session_id,
                    (eff.replica_id, before.home if before else None, before.context_tokens if before else 0),
                )
        if request.session_key is not None:
            self._seed_mirror(mirror, request.session_key)
        lease = mirror.acquire(decision, request)
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                s = mirror.session(eff.session_id)
                prev = self._degraded_binds.get(eff.session_id)
                if s is not None and s.home is not None and prev is not None:
                    self._degraded_binds[eff.session_id] = (s.home, prev[1], s.context_tokens)
        local = Lease(
            lease_id=f"{self.gateway_id}/local/{lease.lease_id}",
            replica_id=lease.replica_id,
            session_id=lease.session_id,
            reason=lease.reason,
            acquired_at=lease.acquired_at,
            disagreement=lease.disagreement,
            prev_context_tokens=lease.prev_context_tokens,
        )
        self._local_leases[local.lease_id] = mirror
        self._local_inner[local.lease_id] = lease
        return local

    async def _redis_acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        now = self.clock.now()
        c = self.config
        args: list[str | int | float] = [
            self.gateway_id,
            self._fleet(now),
            c.session_ttl_s,
            self._session_ttl_ms,
            self._lease_ms,
            decision.replica_id,
            request.session_key or "",
            len(decision.effects),
        ]
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                args += [
                    "B",
                    eff.session_id,
                    eff.replica_id,
                    eff.only_if or "",
                    "1" if eff.reason in PLACEMENT_REASONS else "0",
                ]
            elif isinstance(eff, SetOverflow):
                args += ["O", eff.session_id, len(eff.replicas), *eff.replicas]
        sid = request.session_key
        if self.fast:
            binds_sid = any(isinstance(e, BindSession) and e.session_id == sid for e in decision.effects)
            cached = self._cache.get(sid) if sid is not None else None
            args += ["F", "0" if binds_sid else "1", (cached.home or "") if cached is not None else ""]
        async with self._hot_write():
            res = await self._eval("acquire", args)
            code = int(res[0])
            if code == 0:
                raise KeyError(res[1])
            if code == 2 and sid is not None:
                self.stale_total += 1
                self._cache_row(sid, res[1])
                raise StaleSession(sid)
            target, disagreement, prev, _seq, lost = res[1:6]
            self._lease_seq += 1
            lease = Lease(
                lease_id=f"{self.gateway_id}/{self._lease_seq}",
                replica_id=target,
                session_id=request.session_key,
                reason=decision.reason,
                acquired_at=now,
                disagreement=bool(int(disagreement)),
                prev_context_tokens=int(prev),
            )
            self._leases[lease.lease_id] = lease
            self._own_count(lease, 1)
        if self.fast:
            self._seq_local += 1
            if sid is not None:
                self._cache_row(sid, res[6])
            self._note_binds(decision, lease)
        if int(lost):
            self._need_restore = True
            self._wake.set()
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                if eff.session_id == request.session_key:  # the home is where this request went
                    self._remember(SessionState(eff.session_id, home=lease.replica_id, last_seen=now,
                                                context_tokens=lease.prev_context_tokens))  # fmt: skip
                else:
                    self._sessions.pop(eff.session_id, None)  # relearn at the next snapshot
        return lease

    async def release(self, lease: Lease, completion: Completion) -> None:
        mirror = self._local_leases.pop(lease.lease_id, None)
        if mirror is not None:
            mirror.release(self._local_inner.pop(lease.lease_id), completion)
            return
        if self._leases.pop(lease.lease_id, None) is None:
            return  # unknown or already released: load must never go negative
        self._own_count(lease, -1)
        if self.degraded:
            self.fallback_total += 1  # the restore at resync drops it from Redis's count
            self._need_restore = True
            self._wake.set()
            return
        has_prompt = completion.prompt_tokens is not None
        args: list[str | int | float] = [
            self.gateway_id,
            self._fleet(self.clock.now()),
            self._session_ttl_ms,
            lease.replica_id,
            lease.session_id or "",
            "1" if completion.ok else "0",
            "1" if has_prompt else "0",
            completion.prompt_tokens or 0,
            completion.cached_tokens or 0,
            completion.completion_tokens or 0,
            completion.prompt_bytes,
            self.config.active_window_s,
            {None: "", True: "1", False: "0"}[residency_feedback(lease, completion)],
            self._cache_capacity(lease.replica_id),
        ]
        if self.fast:
            args.append("F")
            if completion.prompt_tokens is not None:
                written = max(0, completion.prompt_tokens - (completion.cached_tokens or 0))
                self._delta(lease.replica_id)[1] += written + (completion.completion_tokens or 0)
        try:
            async with self._hot_write():
                res = await self._eval("release", args)
            if self.fast and lease.session_id is not None and isinstance(res, list):
                self._cache_row(lease.session_id, res)
        except StoreError as exc:
            self.fallback_total += 1
            self._fail(exc)

    def _cache_capacity(self, rid: ReplicaId) -> int:
        """HBM + host of a replica as last seen (0 = unknown): the reference of ``learn_horizon``."""
        for r in self._last_replicas:
            if r.id == rid:
                return r.capacity_tokens + r.host_capacity_tokens if r.capacity_tokens else 0
        return 0

    # ---- fast path: local replica table + session cache (rule 6) ---------------------------------

    def _own_count(self, lease: Lease, k: int) -> None:
        rid = lease.replica_id
        n = self._own_rep.get(rid, 0) + k
        if n > 0:
            self._own_rep[rid] = n
        else:
            self._own_rep.pop(rid, None)
        if lease.session_id is not None:
            d = self._own_sess.setdefault(lease.session_id, {})
            m = d.get(rid, 0) + k
            if m > 0:
                d[rid] = m
            else:
                d.pop(rid, None)
            if not d:
                del self._own_sess[lease.session_id]

    def _delta(self, rid: ReplicaId) -> list[int]:
        bucket = self._deltas[-1]
        d = bucket.get(rid)
        if d is None:
            d = bucket[rid] = [0, 0, 0, 0]
        return d

    def _note_binds(self, decision: RouteDecision, lease: Lease) -> None:
        """Our own placements count on our table at once (others' arrive with the next refresh)."""
        if lease.disagreement:
            return
        for eff in decision.effects:
            if isinstance(eff, BindSession) and eff.replica_id == lease.replica_id:
                d = self._delta(eff.replica_id)
                if eff.reason in PLACEMENT_REASONS:
                    d[0] += 1
                d[2] += 1
                d[3] += lease.prev_context_tokens

    def _cache_row(self, sid: str, row: Any) -> None:
        if isinstance(row, list) and row:
            s = self._session_state(row)
            self._cache[sid] = s
            self._cache.move_to_end(sid)
            if len(self._cache) > _SESSION_CACHE_MAX:
                self._cache.popitem(last=False)
            if s.home is not None:
                self._remember(s)
        else:
            self._cache.pop(sid, None)

    def _with_own(self, s: SessionState) -> SessionState:
        own = self._own_sess.get(s.session_id)
        return replace(s, in_flight=_merge_inflight(s.in_flight, own)) if own else s

    def _table_stale(self) -> bool:
        if self._table is None or self._clean != self._dirty:
            return True
        age = asyncio.get_running_loop().time() - self._table_at
        return age > max(0.5, 10 * self.replica_refresh_s)  # the refresher is starved or failing

    async def _refresh(self, session_key: str | None) -> SessionState | None:
        """One full snapshot round trip: the replica table without our own in-flight (we add it
        exactly), plus one session (``None``: none)."""
        self._table_sent += 1
        gen, dirty = self._table_sent, self._dirty
        cut: dict[ReplicaId, list[int]] = {}
        self._deltas.append(cut)  # deltas recorded from here on may not be in this reply
        now = self.clock.now()
        c = self.config
        seq, rows, srow, active, t0 = await self._eval(
            "snapshot",
            [self._fleet(now), c.active_window_s, c.ramp_window_s, c.session_ttl_s, session_key or "",
             self.gateway_id],
            "refresh",
        )  # fmt: skip
        self.refresh_total += 1
        replicas = tuple(self._replica_state(r) for r in rows)
        if gen > self._table_applied:
            self._table_applied = gen
            self._table = (replicas, int(seq), int(active), self._local(t0) if t0 else None)
            self._table_at = asyncio.get_running_loop().time()
            self._clean = max(self._clean, dirty)
            self._seq_local = 0
            self._last_replicas = replicas
            for i, bucket in enumerate(self._deltas):
                if bucket is cut:
                    del self._deltas[:i]
                    break
        if session_key is None:
            return None
        self._cache_row(session_key, srow)
        return self._cache.get(session_key)

    async def _shared_refresh(self) -> None:
        """Single flight: concurrent snapshots that find the table stale wait for one refresh."""
        fut = self._refreshing
        if fut is None:
            fut = self._refreshing = asyncio.ensure_future(self._refresh(None))

            def done(f: asyncio.Future[SessionState | None]) -> None:
                if self._refreshing is f:
                    self._refreshing = None
                if not f.cancelled():
                    f.exception()  # retrieved: every waiter gets it, none may be left

            fut.add_done_callback(done)
        await asyncio.shield(fut)

    def _composed_replicas(self) -> tuple[ReplicaState, ...]:
        assert self._table is not None
        out = []
        for r in self._table[0]:
            own = self._own_rep.get(r.id, 0)
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

    async def _fast_snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        session: SessionState | None = None
        if self._table_stale():
            await self._shared_refresh()
        if session_key is not None:
            session = self._cache.get(session_key)
            if session is not None and session.last_seen < now - self.config.session_ttl_s:
                session = None  # idle past its TTL: ask Redis (it forgets it, or another gateway kept it)
            if session is None:
                self.session_cache_misses += 1
                row = await self._eval(
                    "sessions",
                    ["one", self._fleet(now), self.config.session_ttl_s, session_key, 0, self.gateway_id],
                    "session",
                )
                self._cache_row(session_key, row)
                session = self._cache.get(session_key)
            else:
                self._cache.move_to_end(session_key)
        assert self._table is not None
        _, seq, active, since = self._table
        return ClusterSnapshot(
            now=now,
            replicas=self._composed_replicas(),
            session=self._with_own(session) if session is not None else None,
            seq=seq + self._seq_local,
            sessions_active=active,
            serving_since=since,
        )

    async def _refresh_loop(self) -> None:
        me = asyncio.current_task()
        while not self._closed and not (me is not None and me.cancelling()):
            await asyncio.sleep(self.replica_refresh_s)
            if self.degraded:
                continue
            try:
                await self._refresh(None)
            except StoreError as exc:
                self._fail(exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the refresher: log it and go on
                log.exception("redis replica refresh failed")

    # ---- StateStore: registry ---------------------------------------------------------------------

    async def _registry(self, op: str, rid: str, a: str = "", b: str = "", c: str = "0") -> int:
        return int(await self._eval("registry", [op, rid, self._fleet(self.clock.now()), a, b, c], op))

    def _expiry(self, spec_source: str) -> str:
        if spec_source != "registry":
            return "0"
        return self._fleet(self.clock.now() + self.config.replica_ttl_s)

    async def _write_registry(
        self, local: Callable[[MemoryCore], None], remote: Callable[[], Awaitable[None]]
    ) -> None:
        """Apply a registry write to Redis, and to the mirror if there is one; queue it if Redis is away."""
        self._ensure_started()
        if self._mirror is not None:
            local(self._mirror)
        if not self.degraded:
            try:
                await remote()
                return
            except StoreError as exc:
                self._fail(exc)
        self.fallback_total += 1
        self._pending_registry.append(remote)

    async def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        self._dirty += 1
        self._spec_cache[spec.id] = spec
        prev = self._registered.get(spec.id)
        self._registered[spec.id] = (spec, status or (prev[1] if prev else ReplicaStatus.JOINING))

        async def remote() -> None:
            await self._registry("upsert", spec.id, _spec_json(spec), status.value if status else "",
                                 self._expiry(spec.source))  # fmt: skip

        await self._write_registry(lambda m: m.upsert_replica(spec, status), remote)

    async def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        self._dirty += 1
        if replica_id in self._registered:
            self._registered[replica_id] = (self._registered[replica_id][0], status)
        if not self.degraded:
            self._ensure_started()
            try:
                if await self._registry("status", replica_id, status.value) == 0:
                    raise KeyError(replica_id)
                if self._mirror is not None and replica_id in {r.id for r in self._mirror.replicas()}:
                    self._mirror.set_status(replica_id, status)
                return
            except StoreError as exc:
                self._fail(exc)

        async def remote() -> None:
            await self._registry("status", replica_id, status.value)

        await self._write_registry(lambda m: m.set_status(replica_id, status), remote)

    async def remove_replica(self, replica_id: ReplicaId) -> None:
        self._dirty += 1
        self._registered.pop(replica_id, None)

        async def remote() -> None:
            await self._registry("remove", replica_id)

        await self._write_registry(lambda m: m.remove_replica(replica_id), remote)

    def _engine_json(self, load: EngineLoad) -> str:
        d = asdict(load)
        d["updated_at"] = float(self._fleet(load.updated_at)) if load.updated_at else 0.0
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    async def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        raw = self._engine_json(load)
        spec = self._spec_cache.get(replica_id)
        exp = self._expiry(spec.source if spec else "registry")

        async def remote() -> None:
            await self._registry("engine", replica_id, raw, "", exp)

        if self.degraded:
            # engine figures are refreshed every few seconds: no point replaying stale ones
            if self._mirror is not None:
                self._mirror.report_engine_load(replica_id, load)
            self.fallback_total += 1
            return
        await self._write_registry(lambda m: m.report_engine_load(replica_id, load), remote)

    # ---- StateStore: views -----------------------------------------------------------------------

    async def replicas(self) -> tuple[ReplicaState, ...]:
        return (await self.snapshot(None)).replicas

    async def session(self, session_id: str) -> SessionState | None:
        self._ensure_started()
        if not self.degraded:
            try:
                row = await self._eval(
                    "sessions",
                    ["one", self._fleet(self.clock.now()), self.config.session_ttl_s, session_id, 0],
                    "session",
                )
                return self._session_state(row) if row else None
            except StoreError as exc:
                self._fail(exc)
        self.fallback_total += 1
        mirror = self._mirror_core()
        self._seed_mirror(mirror, session_id)
        return mirror.session(session_id)

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        self._ensure_started()
        if not self.degraded:
            try:
                rows = await self._eval(
                    "sessions",
                    [
                        "on",
                        self._fleet(self.clock.now()),
                        self.config.session_ttl_s,
                        replica_id,
                        max(1, limit),
                    ],
                    "sessions_on",
                )
                return tuple(self._session_state(r) for r in rows)
            except StoreError as exc:
                self._fail(exc)
        self.fallback_total += 1
        return self._mirror_core().sessions_on(replica_id, limit)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the heartbeat and say goodbye (our in-flight counts vanish at once), then disconnect."""
        if self._closed:
            return
        self._closed = True
        for task in (self._task, self._refresher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not self.degraded:
            with contextlib.suppress(StoreError):
                await self._eval("lease", ["bye", self.gateway_id], "bye")
        with contextlib.suppress(rexc.RedisError, OSError):
            await self.client.aclose()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and the admin API."""
        return {
            "backend": "redis",
            "gateway_id": self.gateway_id,
            "degraded": self.degraded,
            "degraded_total": self.degraded_total,
            "fallback_total": self.fallback_total,
            "resync_total": self.resync_total,
            "round_trips_total": self.round_trips_total,
            "fast_path": self.fast,
            "refresh_total": self.refresh_total,
            "session_cache_misses": self.session_cache_misses,
            "stale_total": self.stale_total,
            "leases_outstanding": len(self._leases) + len(self._local_leases),
            "last_error": self.last_error,
        }


GATEWAY_REPLICA_REFRESH_S = 0.05
"""The gateway's default replica-table refresh period (the fast path, 2 round trips per request).
``KVROUTE_REDIS_REFRESH_S=0`` selects the 3-round-trip path."""

REFRESH_ENV = "KVROUTE_REDIS_REFRESH_S"


def gateway_refresh_s(config: Any, environ: Mapping[str, str]) -> float:
    """``store.replica_refresh_s`` of the config if it has one, else ``$KVROUTE_REDIS_REFRESH_S``,
    else :data:`GATEWAY_REPLICA_REFRESH_S`."""
    value = getattr(getattr(config, "store", None), "replica_refresh_s", None)
    if value is None:
        raw = environ.get(REFRESH_ENV, "").strip()
        try:
            value = float(raw) if raw else GATEWAY_REPLICA_REFRESH_S
        except ValueError as exc:
            raise ConfigError(f"{REFRESH_ENV}: not a number: {raw!r}") from exc
    if not 0 <= float(value) <= 60:
        raise ConfigError(f"{REFRESH_ENV}: must be within [0, 60] seconds, got {value}")
    return float(value)


def make_redis_store(config: Any, clock: Clock, environ: Mapping[str, str] | None = None) -> RedisStore:
    """Build the gateway's store from a ``GatewayConfig`` (``redis_url``, ``gateway_id``, ``store``)."""
    url = getattr(config, "redis_url", None)
    if not url:
        raise StoreError("make_redis_store: no redis_url configured")
    store_settings = getattr(config, "store", None)
    store_config = store_settings.to_store_config() if store_settings is not None else StoreConfig()
    gateway_id = str(getattr(config, "gateway_id", "") or "").replace("|", "_") or None
    refresh = gateway_refresh_s(config, os.environ if environ is None else environ)
    return RedisStore.from_url(url, gateway_id, store_config, clock, replica_refresh_s=refresh)
