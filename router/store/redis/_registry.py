"""Registry writes of the Redis store: replicas registered, their status, their engine figures.

Rules:
  1. A write goes to Redis and, while a mirror exists, to the mirror too; if Redis is away it is
     queued (``Fallback.pending``) and replayed in order at the resync. Engine figures are the
     exception: they are refreshed every few seconds, so stale ones are never replayed.
  2. Entries written by sidecars (``source == "registry"``) expire ``replica_ttl_s`` after their last
     write; static and admin entries do not.
  3. Every write marks the fast path's replica table dirty, so the next snapshot sees it.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping

from router.errors import ReplicaNotFoundError, StoreError
from router.model import EngineLoad, HealthStamp, ReplicaId, ReplicaSpec, ReplicaStatus
from router.store.base import StoreConfig
from router.store.memory import MemoryCore
from router.store.redis._fallback import Fallback
from router.store.redis._fastpath import FastPath
from router.store.redis._wire import RedisWire, spec_json

__all__ = ["Registry"]


class Registry:
    def __init__(
        self,
        wire: RedisWire,
        config: StoreConfig,
        fallback: Fallback,
        fast: FastPath,
        *,
        started: Callable[[], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self._wire = wire
        self._config = config
        self._fallback = fallback
        self._fast = fast
        self._started = started  # the store's background tasks run from the first call
        self._failed = failed  # the store turns degraded

    async def call(self, op: str, rid: str, a: str = "", b: str = "", c: str = "0") -> int:
        return int(await self._wire.eval("registry", [op, rid, self._wire.now(), a, b, c], op))

    def expiry(self, spec_source: str) -> str:
        """Rule 2: the fleet time a registry entry expires at ("0": never)."""
        if spec_source != "registry":
            return "0"
        return self._wire.fleet(self._wire.clock.now() + self._config.replica_ttl_s)

    async def _write(self, local: Callable[[MemoryCore], None], remote: Callable[[], Awaitable[None]]) -> None:
        self._started()
        fb = self._fallback
        if fb.mirror is not None:
            local(fb.mirror)
        if not fb.degraded:
            try:
                await remote()
                return
            except StoreError as exc:
                self._failed(exc)
        fb.fallback_total += 1
        fb.pending.append(remote)

    async def upsert(self, spec: ReplicaSpec, status: ReplicaStatus | None) -> None:
        self._fast.mark_dirty()
        self._wire.specs[spec.id] = spec
        prev = self._fallback.registered.get(spec.id)
        self._fallback.registered[spec.id] = (spec, status or (prev[1] if prev else ReplicaStatus.JOINING))

        async def remote() -> None:
            await self.call("upsert", spec.id, spec_json(spec), status.value if status else "",
                            self.expiry(spec.source))  # fmt: skip

        await self._write(lambda m: m.upsert_replica(spec, status), remote)

    async def set_status(self, replica_id: ReplicaId, status: ReplicaStatus) -> None:
        self._fast.mark_dirty()
        fb = self._fallback
        if replica_id in fb.registered:
            fb.registered[replica_id] = (fb.registered[replica_id][0], status)
        if not fb.degraded:
            self._started()
            try:
                if await self.call("status", replica_id, status.value) == 0:
                    raise ReplicaNotFoundError(replica_id)
                if fb.mirror is not None and replica_id in {r.id for r in fb.mirror.replicas()}:
                    fb.mirror.set_status(replica_id, status)
                return
            except StoreError as exc:
                self._failed(exc)

        async def remote() -> None:
            await self.call("status", replica_id, status.value)

        await self._write(lambda m: m.set_status(replica_id, status), remote)

    async def remove(self, replica_id: ReplicaId) -> None:
        self._fast.mark_dirty()
        self._fallback.registered.pop(replica_id, None)

        async def remote() -> None:
            await self.call("remove", replica_id)

        await self._write(lambda m: m.remove_replica(replica_id), remote)

    async def report_engine_load(self, replica_id: ReplicaId, load: EngineLoad) -> None:
        raw = self._wire.engine_json(load)
        spec = self._wire.specs.get(replica_id)
        exp = self.expiry(spec.source if spec else "registry")

        async def remote() -> None:
            await self.call("engine", replica_id, raw, "", exp)

        fb = self._fallback
        if fb.degraded:
            # rule 1: engine figures are refreshed every few seconds, no point replaying stale ones
            if fb.mirror is not None:
                fb.mirror.report_engine_load(replica_id, load)
            fb.fallback_total += 1
            return
        await self._write(lambda m: m.report_engine_load(replica_id, load), remote)

    async def report_health(self, stamps: Mapping[ReplicaId, HealthStamp]) -> None:
        """Good health checks, shared (discovery rule 7). Like engine figures they are never replayed:
        while Redis is away only the mirror keeps them (every gateway then checks for itself)."""
        fb = self._fallback
        if fb.mirror is not None:
            fb.mirror.report_health(stamps)
        if fb.degraded or not stamps:
            return
        raw = json.dumps({rid: f"{self._wire.fleet(st.at)}|{st.fresh_s!r}|{st.by}" for rid, st in stamps.items()})
        self._started()
        try:
            await self._wire.eval("registry", ["health", "", self._wire.now(), raw, "", "0"], "health")
        except StoreError as exc:
            self._failed(exc)

    async def health_stamps(self) -> dict[ReplicaId, HealthStamp]:
        fb = self._fallback
        if not fb.degraded:
            self._started()
            try:
                flat = await self._wire.eval("registry", ["health_read", "", self._wire.now(), "", "", "0"],
                                             "health_read")  # fmt: skip
                out: dict[ReplicaId, HealthStamp] = {}
                for rid, raw in zip(flat[::2], flat[1::2], strict=True):
                    at, fresh, by = raw.split("|", 2)
                    out[rid] = HealthStamp(at=self._wire.local(at), by=by, fresh_s=float(fresh))
                return out
            except StoreError as exc:
                self._failed(exc)
        return dict(fb.mirror.health) if fb.mirror is not None else {}

    async def republish(self, mirror: MemoryCore) -> None:
        """Redis came back empty: give it the replicas (and engine figures) the mirror knows."""
        for r in mirror.replicas():
            spec = self._wire.spec_of(r.id, r.url, r.model)
            await self.call("upsert", r.id, spec_json(spec), r.status.value, self.expiry(spec.source))
            if r.engine.updated_at:
                await self.call("engine", r.id, self._wire.engine_json(r.engine), "", self.expiry(spec.source))
