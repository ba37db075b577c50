"""``RedisStore``: the ``StateStore`` over Redis. The hot path (snapshot, acquire, release), this
gateway's lease and its heartbeat, the resync after an outage, and the lifecycle. The package
docstring (``router.store.redis``) states the rules; the parts live beside this module."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import socket
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.clock import Clock, SystemClock
from router.errors import ConfigError, ReplicaNotFoundError, StaleSessionError, StoreError
from router.eventloop import stop_tasks
from router.model import (
    MAX_CHAINS,
    BindSession,
    ClusterSnapshot,
    Completion,
    EngineLoad,
    HealthStamp,
    Lease,
    PinKind,
    ReplicaId,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
    SetOverflow,
)
from router.residency import ResidencyView, snapshot_with_residency
from router.store.base import StoreConfig, residency_feedback
from router.store.keys import KeySpace
from router.store.memory import PLACEMENT_REASONS, Pins
from router.store.redis._fallback import Fallback
from router.store.redis._fastpath import ROWS_PER_REFRESH, FastPath
from router.store.redis._leases import OwnLeases
from router.store.redis._registry import Registry
from router.store.redis._wire import RedisWire, map_redis_errors

__all__ = ["GATEWAY_REPLICA_REFRESH_S", "REFRESH_ENV", "RedisStore", "gateway_refresh_s", "make_redis_store"]

log = logging.getLogger("kvroute.store.redis")

_CHAIN_UNSAFE = re.compile(r"[,=]")


def _split_cluster_flag(url: str) -> tuple[str, bool]:
    """``url`` without its ``cluster=`` query key, and whether that key asked for Redis Cluster.
    Only the query is rewritten: a round trip through urlunsplit would turn ``unix:///path`` into
    ``unix:/path``, which redis-py refuses."""
    base, sep, q = url.partition("?")
    if not sep:
        return url, False
    query = parse_qsl(q, keep_blank_values=True)
    flag = any(k == "cluster" and v.lower() in {"1", "true", "yes"} for k, v in query)
    rest = urlencode([(k, v) for k, v in query if k != "cluster"])
    return base + ("?" + rest if rest else ""), flag


class RedisStore:
    """``StateStore`` over Redis (single node or Cluster). One instance per gateway process.

    Attributes for metrics: ``degraded`` (serving from local state now), ``degraded_total``
    (times it entered degraded mode), ``fallback_total`` (operations served locally because Redis
    failed or was away), ``resync_total``, ``last_error``, ``round_trips_total``; with the fast
    path ``refresh_total``, ``session_cache_misses``, ``stale_total``.
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
        rows_per_refresh: int = ROWS_PER_REFRESH,
    ) -> None:
        self.gateway_id = gateway_id or f"{socket.gethostname()[:24]}-{secrets.token_hex(4)}"
        if "|" in self.gateway_id:
            raise ValueError(f"gateway id must not contain '|': {self.gateway_id!r}")
        # The name this process holds its lease and in-flight counts under in Redis: unique per process.
        # A gateway restarted under the same configured id (a pod's name survives a container restart;
        # deploy/ sets KVROUTE_GATEWAY_ID to it) must not adopt the session counts its SIGKILLed
        # predecessor left behind: those belong to a lease that expires, and are then dropped.
        self.lease_holder = f"{self.gateway_id}~{secrets.token_hex(4)}"
        self.config = config or StoreConfig()
        self.residency: ResidencyView | None = None  # fills SessionState.resident_* (router/residency.py)
        self.clock = clock or SystemClock()
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.last_error: str | None = None
        self._wire = RedisWire(
            client, KeySpace(self.config.key_prefix), self.clock,
            epoch_offset_s=epoch_offset_s, op_timeout_s=op_timeout_s,
        )  # fmt: skip
        self._lease_ms = max(1, int(self.config.lease_ttl_s * 1000))
        self._session_ttl_ms = max(1, int(self.config.session_ttl_s * 1000))
        self._own = OwnLeases(self.lease_holder)
        self._fallback = Fallback(self._wire, self.clock, self.config, self.lease_holder)
        self._fast = FastPath(
            self._wire, self.config, self.lease_holder, self._own, self._fallback, replica_refresh_s, rows_per_refresh
        )
        # pins this gateway made or looked up: served from here while Redis is away
        self._pins = Pins(self.clock, self.config.session_ttl_s)
        self._registry = Registry(
            self._wire, self.config, self._fallback, self._fast, started=self._ensure_started, failed=self._fail
        )
        # hot-path writes in progress; a restore waits for them, and new ones wait for the restore
        self._writes = 0
        self._writes_idle = asyncio.Event()
        self._writes_idle.set()
        self._gate = asyncio.Event()  # cleared while a restore runs
        self._gate.set()
        self._need_restore = True  # first heartbeat publishes our (empty) state and our lease
        self._wake = asyncio.Event()
        self._keeper_task: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None
        self._closed = False

    # ---- public figures --------------------------------------------------------------------------

    @property
    def client(self) -> aioredis.Redis | RedisCluster:
        return self._wire.client

    @property
    def keys(self) -> KeySpace:
        return self._wire.keys

    @property
    def op_timeout_s(self) -> float:
        return self._wire.op_timeout_s

    @property
    def replica_refresh_s(self) -> float:
        return self._fast.refresh_s

    @property
    def fast(self) -> bool:
        return self._fast.on

    @property
    def degraded(self) -> bool:
        return self._fallback.degraded

    @property
    def degraded_total(self) -> int:
        return self._fallback.degraded_total

    @property
    def fallback_total(self) -> int:
        return self._fallback.fallback_total

    @property
    def resync_total(self) -> int:
        return self._fallback.resync_total

    @property
    def round_trips_total(self) -> int:
        return self._wire.round_trips_total

    @property
    def refresh_total(self) -> int:
        return self._fast.refresh_total

    @property
    def session_cache_misses(self) -> int:
        return self._fast.session_cache_misses

    @property
    def stale_total(self) -> int:
        return self._fast.stale_total

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

    # ---- plumbing --------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._keeper_task is None and not self._closed:
            self._keeper_task = asyncio.get_running_loop().create_task(self._keeper(), name="kvroute-redis-keeper")
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
        self._fallback.enter(exc)
        self._wake.set()

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
                    lost, _dead = await self._wire.eval("lease", ["beat", self.lease_holder, self._lease_ms])
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
            # cleared before the counts are taken: a lease released (locally, while degraded) during
            # the round trip asks for another restore, which must not be overwritten afterwards
            self._need_restore = False
            args: list[str | int | float] = ["restore", self.lease_holder, self._lease_ms, *self._own.restore_args()]
            sent = set(self._own.suspects)
            try:
                await self._wire.eval("lease", args, "restore")
            except BaseException:
                self._need_restore = True
                raise
            self._own.suspects -= sent
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
        client = self.client
        if not isinstance(client, RedisCluster):
            with contextlib.suppress(rexc.RedisError, OSError):
                await client.connection_pool.disconnect(inuse_connections=False)
        fb = self._fallback
        snap = await self._redis_snapshot(None)
        if not snap.replicas and fb.mirror is not None:
            # an empty Redis (restarted without persistence) gets our view back, with compare-and-set
            await self._registry.republish(fb.mirror)
            fb.keep_all_homes()
        while fb.pending:
            await fb.pending[0]()
            fb.pending.pop(0)
        if fb.binds:
            items = list(fb.binds.items())
            args: list[str | int | float] = [
                self._wire.now(),
                self.config.session_ttl_s,
                self._session_ttl_ms,
                len(items),
            ]
            for sid, (rid, only_if, ctx) in items:
                args += [sid, rid, only_if or "", ctx]
            homes = await self._wire.eval("republish", args)
            for (sid, (rid, _, _)), home in zip(items, homes, strict=True):
                fb.sessions.pop(sid, None)
                fb.binds.pop(sid, None)
                if home != rid:
                    log.info("session %s was bound elsewhere meanwhile; %s wins", sid, home)
        # our in-flight counts last: the sessions they belong to exist again by now
        await self._restore()
        # a last snapshot refreshes what the mirror would start from next time
        await self._redis_snapshot(None)
        self._fast.forget()
        fb.leave()
        log.warning("redis is back: state resynchronised")

    async def _refresh_loop(self) -> None:
        me = asyncio.current_task()
        while not self._closed and not (me is not None and me.cancelling()):
            await asyncio.sleep(self._fast.refresh_s)
            if self.degraded:
                continue
            try:
                await self._fast.refresh(None)
            except StoreError as exc:
                self._fail(exc)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop the refresher: log it and go on
                log.exception("redis replica refresh failed")

    # ---- StateStore: hot path --------------------------------------------------------------------

    async def _redis_snapshot(self, session_key: str | None) -> ClusterSnapshot:
        now = self.clock.now()
        c = self.config
        seq, rows, srow, active, t0 = await self._wire.eval(
            "snapshot",
            [self._wire.fleet(now), c.active_window_s, c.ramp_window_s, c.session_ttl_s, session_key or ""],
        )
        replicas = tuple(self._wire.replica_state(r) for r in rows)
        self._fallback.last_replicas = replicas
        session = self._wire.session_state(srow) if srow else None
        if session is not None and session.home is not None:
            self._fallback.remember(session)
        return ClusterSnapshot(
            now=now,
            replicas=replicas,
            session=session,
            seq=int(seq),
            sessions_active=int(active),
            serving_since=self._wire.local(t0) if t0 else None,
        )

    async def snapshot(self, session_key: str | None) -> ClusterSnapshot:
        snap = await self._snapshot(session_key)
        # exact residency (router/residency.py): from this gateway's subscribers or the Redis mirror
        return snap if self.residency is None else snapshot_with_residency(snap, self.residency, session_key)

    async def _snapshot(self, session_key: str | None) -> ClusterSnapshot:
        self._ensure_started()
        if not self.degraded:
            try:
                if self.fast:
                    return await self._fast.snapshot(session_key)
                return await self._redis_snapshot(session_key)
            except StoreError as exc:
                self._fail(exc)
        return self._fallback.snapshot(session_key)

    async def acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        self._ensure_started()
        if not self.degraded:
            try:
                return await self._redis_acquire(decision, request)
            except StoreError as exc:
                if request.session_key is not None:
                    self._own.suspects.add(request.session_key)
                self._fail(exc)
        return self._fallback.acquire(decision, request)

    async def _redis_acquire(self, decision: RouteDecision, request: RouteRequest) -> Lease:
        now = self.clock.now()
        c = self.config
        args: list[str | int | float] = [
            self.lease_holder,
            self._wire.fleet(now),
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
        fast = self._fast
        if fast.on:
            binds_sid = any(isinstance(e, BindSession) and e.session_id == sid for e in decision.effects)
            args += ["F", "0" if binds_sid else "1", fast.cached_home(sid)]
        ck = request.chain_key
        if sid is not None and ck and not _CHAIN_UNSAFE.search(ck):  # ',' and '=' frame the stored list
            args += ["C", ck, MAX_CHAINS]
        async with self._hot_write():
            res = await self._wire.eval("acquire", args)
            code = int(res[0])
            if code == 0:
                raise ReplicaNotFoundError(res[1])
            if code == 2 and sid is not None:
                fast.stale_total += 1
                fast.cache_row(sid, res[1])
                raise StaleSessionError(sid)
            target, disagreement, prev, _seq, lost = res[1:6]
            lease = Lease(
                lease_id=self._own.next_id(),
                replica_id=target,
                session_id=request.session_key,
                reason=decision.reason,
                acquired_at=now,
                disagreement=bool(int(disagreement)),
                prev_context_tokens=int(prev),
            )
            self._own.add(lease)
        if fast.on:
            fast.seq_local += 1
            if sid is not None:
                fast.cache_row(sid, res[6])
            fast.note_binds(decision, lease)
        if int(lost):
            self._need_restore = True
            self._wake.set()
        for eff in decision.effects:
            if isinstance(eff, BindSession):
                if eff.session_id == request.session_key:  # the home is where this request went
                    self._fallback.remember(SessionState(eff.session_id, home=lease.replica_id, last_seen=now,
                                                         context_tokens=lease.prev_context_tokens))  # fmt: skip
                else:
                    self._fallback.sessions.pop(eff.session_id, None)  # relearn at the next snapshot
        return lease

    async def release(self, lease: Lease, completion: Completion) -> None:
        if self._fallback.release(lease, completion):
            return
        if not self._own.pop(lease):
            return  # unknown or already released: load must never go negative
        if self.degraded:
            self._fallback.fallback_total += 1  # the restore at resync drops it from Redis's count
            if lease.session_id is not None:
                # ... and the session's field: the restore resets only the sessions it is told of
                self._own.suspects.add(lease.session_id)
            self._need_restore = True
            self._wake.set()
            return
        has_prompt = completion.prompt_tokens is not None
        args: list[str | int | float] = [
            self.lease_holder,
            self._wire.now(),
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
            max(1, completion.samples),
        ]
        fast = self._fast
        if fast.on:
            args.append("F")
            if completion.prompt_tokens is not None:
                written = max(0, completion.prompt_tokens - (completion.cached_tokens or 0))
                fast.note_written(lease.replica_id, written + (completion.completion_tokens or 0))
        try:
            async with self._hot_write():
                res = await self._wire.eval("release", args)
            if fast.on and lease.session_id is not None and isinstance(res, list):
                fast.cache_row(lease.session_id, res)
        except StoreError as exc:
            self._fallback.fallback_total += 1
            if lease.session_id is not None:  # the decrement may not have landed: reset the session too
                self._own.suspects.add(lease.session_id)
            self._fail(exc)

    def _cache_capacity(self, rid: ReplicaId) -> int:
        """HBM + host of a replica as last seen (0 = unknown): the reference of ``learn_horizon``."""
        for r in self._fallback.last_replicas:
            if r.id == rid:
                return r.capacity_tokens + r.host_capacity_tokens if r.capacity_tokens else 0
        return 0

    # ---- StateStore: registry ---------------------------------------------------------------------

    async def upsert_replica(self, spec: ReplicaSpec, status: ReplicaStatus | None = None) -> None:
        await self._registry.upsert(spec, status)

    async def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        await self._registry.set_status(replica_id, status)

    async def remove_replica(self, replica_id: ReplicaId) -> None:
        await self._registry.remove(replica_id)

    async def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        await self._registry.report_engine_load(replica_id, load)

    async def report_health(self, stamps: Mapping[ReplicaId, HealthStamp]) -> None:
        await self._registry.report_health(stamps)

    async def health_stamps(self) -> Mapping[ReplicaId, HealthStamp]:
        return await self._registry.health_stamps()

    async def probers(self) -> tuple[str, ...]:
        """Live lease holders (``lease_holder`` is this gateway's prober id); none while degraded."""
        if self.degraded:
            return ()
        self._ensure_started()
        try:
            return tuple(sorted(await self._wire.eval("lease", ["live", ""], "live")))
        except StoreError as exc:
            self._fail(exc)
            return ()

    # ---- StateStore: views -----------------------------------------------------------------------

    async def replicas(self) -> tuple[ReplicaState, ...]:
        return (await self.snapshot(None)).replicas

    async def session(self, session_id: str) -> SessionState | None:
        self._ensure_started()
        if not self.degraded:
            try:
                row = await self._wire.eval(
                    "sessions", ["one", self._wire.now(), self.config.session_ttl_s, session_id, 0], "session"
                )
                return self._wire.session_state(row) if row else None
            except StoreError as exc:
                self._fail(exc)
        return self._fallback.session(session_id)

    async def sessions_on(self, replica_id: ReplicaId, limit: int = 1000) -> tuple[SessionState, ...]:
        self._ensure_started()
        if not self.degraded:
            try:
                rows = await self._wire.eval(
                    "sessions",
                    ["on", self._wire.now(), self.config.session_ttl_s, replica_id, max(1, limit)],
                    "sessions_on",
                )
                return tuple(self._wire.session_state(r) for r in rows)
            except StoreError as exc:
                self._fail(exc)
        return self._fallback.sessions_on(replica_id, limit)

    # ---- pins (SGLang's /open_session, stored responses) -------------------------------------------
    # One string per pin, "<replica>|<last use, fleet s>": expiry is judged on the store's clock,
    # as a session's is; PX only deletes what nobody used for a TTL.

    async def pin(self, kind: PinKind, name: str, replica_id: ReplicaId) -> None:
        self._pins.pin(kind, name, replica_id)
        if self.degraded:
            return  # this gateway's own pin only: not replayed into Redis
        self._ensure_started()
        key = self._wire.keys.pin(kind, name)
        try:
            await self._wire.command(
                "pin", "SET", key, f"{replica_id}|{self._wire.now()}", "PX", self._session_ttl_ms
            )
        except StoreError as exc:
            self._fail(exc)

    async def pinned(self, kind: PinKind, name: str) -> ReplicaId | None:
        if not self.degraded:
            self._ensure_started()
            key = self._wire.keys.pin(kind, name)
            try:
                rid, _, used = str(await self._wire.command("pinned", "GET", key) or "").rpartition("|")
                if not rid or self._wire.local(used or 0) <= self.clock.now() - self.config.session_ttl_s:
                    self._pins.unpin(kind, name)
                    return None
                # XX: a pin dropped meanwhile (a session closed) stays dropped
                await self._wire.command(
                    "pin", "SET", key, f"{rid}|{self._wire.now()}", "XX", "PX", self._session_ttl_ms
                )
            except StoreError as exc:
                self._fail(exc)
            else:
                self._pins.pin(kind, name, rid)
                return rid
        return self._pins.get(kind, name)

    async def share_config(self, doc: str) -> int:
        if self.degraded:
            raise StoreError(f"redis is degraded ({self.last_error}): the config cannot be shared")
        self._ensure_started()
        try:
            return int(await self._wire.eval("config", ["set", doc]))
        except StoreError as exc:
            self._fail(exc)
            raise

    async def shared_config(self, known: int) -> tuple[int, str | None]:
        if self.degraded:
            return known, None
        self._ensure_started()
        try:
            got = await self._wire.eval("config", ["get", known])
        except StoreError as exc:
            self._fail(exc)
            return known, None
        gen = int(got[0])
        doc = got[1] if len(got) > 1 else None
        return gen, doc.decode() if isinstance(doc, bytes) else doc

    async def reserve(self, kind: PinKind, name: str, replica_id: ReplicaId) -> bool:
        if not self.degraded:
            self._ensure_started()
            key = self._wire.keys.pin(kind, name)
            try:
                done = await self._wire.command(
                    "reserve", "SET", key, f"{replica_id}|{self._wire.now()}", "NX", "PX", self._session_ttl_ms
                )
            except StoreError as exc:
                self._fail(exc)
            else:
                if done:
                    self._pins.pin(kind, name, replica_id)
                return bool(done)
        # degraded: this gateway's own pins only, as ``pin`` writes them meanwhile
        return self._pins.reserve(kind, name, replica_id)

    async def unpin(self, kind: PinKind, name: str) -> None:
        self._pins.unpin(kind, name)
        if self.degraded:
            return
        self._ensure_started()
        try:
            await self._wire.command("unpin", "DEL", self._wire.keys.pin(kind, name))
        except StoreError as exc:
            self._fail(exc)

    # ---- lifecycle -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the heartbeat and say goodbye (our in-flight counts vanish at once), then disconnect."""
        if self._closed:
            return
        self._closed = True
        await stop_tasks(self._keeper_task, self._refresher)
        if not self.degraded:
            with contextlib.suppress(StoreError):
                await self._wire.eval("lease", ["bye", self.lease_holder], "bye")
        with contextlib.suppress(rexc.RedisError, OSError):
            await self.client.aclose()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and the admin API."""
        return {
            "backend": "redis",
            "gateway_id": self.gateway_id,
            "lease_holder": self.lease_holder,
            "degraded": self.degraded,
            "degraded_total": self.degraded_total,
            "fallback_total": self.fallback_total,
            "resync_total": self.resync_total,
            "round_trips_total": self.round_trips_total,
            "fast_path": self.fast,
            "refresh_total": self.refresh_total,
            "partial_refresh_total": self._fast.partial_refresh_total,
            "session_cache_misses": self.session_cache_misses,
            "stale_total": self.stale_total,
            "leases_outstanding": len(self._own) + self._fallback.local_leases,
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
