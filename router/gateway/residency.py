"""The gateway's exact residency: which ``ResidencyView`` it holds and what keeps it fed.

``kv_events.mode`` (docs/KV_EVENTS.md, docs/CONFIG.md):
  * ``auto`` / ``subscribe``: a ``ResidencyIndex`` fed by one subscriber per replica that advertises
    a ZMQ publisher in its ``/server_info`` (``router.kv_events.KvEventsManager``); the registry is
    re-read every ``refresh_s``. ``auto`` without the ``kvevents`` extra is ``off`` (logged once).
    With ``publish`` the answers are also written to Redis (``router.store.residency``).
  * ``redis``: a ``RedisResidencyMirror`` of what the writers (sidecars, or a publishing gateway)
    share; no subscription here.

The view is attached to the store (``store.residency``), which fills ``SessionState.resident_tokens``
and ``resident_on`` in every snapshot; the admin API reads ``source(replica)`` from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from router.config import GatewayConfig
from router.errors import ConfigError
from router.eventloop import stop_tasks
from router.gateway.forward import with_first_field
from router.residency import OFF, ResidencyIndex, ResidencyView
from router.store.base import StateStore

if TYPE_CHECKING:
    from router.gateway.egress import EgressGuard
    from router.gateway.forward import ReplicaClient

__all__ = ["ResidencyService", "make_residency", "with_session_id"]

log = logging.getLogger("kvroute.residency")


class ResidencyService:
    """What the gateway holds: the view plus the tasks feeding it (``start`` / ``close``)."""

    def __init__(self, view: ResidencyView, mode: str) -> None:
        self.view = view
        self.mode = mode
        self.manager: Any = None  # router.kv_events.KvEventsManager (subscribe modes)
        self.writer: Any = None  # router.store.residency.RedisResidencyWriter (publish)
        self.mirror: Any = None  # router.store.residency.RedisResidencyMirror (redis mode)
        self._tasks: list[asyncio.Task[None]] = []
        self._closers: list[Any] = []
        self.first_refresh = asyncio.Event()  # the registry was read once and its replicas subscribed to

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode}
        if isinstance(self.view, ResidencyIndex):
            out["replicas"] = self.view.stats()
        if self.manager is not None:
            out["subscribers"] = self.manager.stats()
        if self.writer is not None:
            out["writer"] = {"writes": self.writer.writes, "entries": self.writer.entries, "errors": self.writer.errors}
        if self.mirror is not None:
            m = self.mirror
            out["mirror"] = {"stale": m.stale, "reads": m.reads, "entries": m.entries, "gaps": m.gaps, "errors": m.errors}
        return out

    def subscribed(self, replica_id: str) -> bool:
        """Whether this replica's events are followed (so forwarding the session id pays off)."""
        return self.view.source(replica_id) != OFF

    async def ready(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the engines' replays are applied, so that a gateway
        that starts (or restarts on embedded state) serves its first requests on what the engines
        hold; whether they were. True at once when there is nothing to subscribe to."""
        if self.manager is None:
            return True
        synced = False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):  # not wait_for: it can lose a cancel (docs/RELIABILITY.md)
                await self.first_refresh.wait()
                synced = await self.manager.wait_synced()
        if not synced:
            log.warning("kv events: not every replica's replay was in within %.1f s; serving on what is", timeout_s)
        return synced

    async def close(self) -> None:
        await stop_tasks(*self._tasks)
        for c in reversed(self._closers):
            await c()


def make_residency(
    config: GatewayConfig,
    store: StateStore,
    client: ReplicaClient,
    *,
    egress: EgressGuard | None = None,
    clock_sleep: Any = asyncio.sleep,
) -> ResidencyService | None:
    """Build and start (on the running loop) what ``kv_events`` asks for; ``None`` when it is off.
    ``ConfigError`` when ``subscribe`` is asked for without the ``kvevents`` extra."""
    kv = config.kv_events
    if kv.mode == "off":
        return None
    if kv.mode == "redis":
        return _redis_mirror(config, store)
    try:
        from router.kv_events import KvEventsManager, json_fetcher
    except ImportError as exc:
        if kv.mode == "subscribe":
            raise ConfigError(f"kv_events.mode: subscribe needs the kvevents extra (pyzmq, msgspec): {exc}") from None
        log.info("kv events: off (the kvevents extra is not installed: %s)", exc)
        return None
    index = ResidencyIndex(kv.max_blocks_per_replica, kv.max_sessions_per_replica, track_changes=kv.publish)
    svc = ResidencyService(index, kv.mode)
    manager = KvEventsManager(index, json_fetcher(client.fetch, config.timeouts.probe_s), replay_timeout_s=kv.replay_timeout_s)
    svc.manager = manager

    async def follow_registry() -> None:
        while True:
            # only replicas whose URL the egress rules allow (the ZMQ endpoints are on their hosts)
            replicas = [r for r in await store.replicas() if egress is None or await egress.allowed(r.url)]
            await manager.refresh([(r.id, r.url, r.dp_rank) for r in replicas])
            svc.first_refresh.set()
            await clock_sleep(kv.refresh_s)

    svc._tasks.append(asyncio.get_running_loop().create_task(follow_registry(), name="kvroute-kv-events"))
    svc._closers.append(manager.close)
    if kv.publish:
        from router.store.residency import RedisResidencyWriter

        redis_client = getattr(store, "client", None)
        keys = getattr(store, "keys", None)
        if redis_client is None:
            raise ConfigError("kv_events.publish: the store is not Redis")
        writer = RedisResidencyWriter(
            redis_client, index, keys=keys, writer_id=config.gateway_id, flush_s=kv.flush_s, ttl_s=kv.ttl_s
        )
        svc.writer = writer
        svc._tasks.append(asyncio.get_running_loop().create_task(writer.run(), name="kvroute-residency-writer"))
        svc._closers.append(writer.close)
    _attach(store, index)
    return svc


def _redis_mirror(config: GatewayConfig, store: StateStore) -> ResidencyService:
    import redis.asyncio as aioredis

    from router.store.keys import KeySpace
    from router.store.residency import RedisResidencyMirror

    assert config.redis_url is not None  # validated with the config
    url = config.redis_url
    if "cluster=1" in url:
        from redis.asyncio.cluster import RedisCluster

        client: Any = RedisCluster.from_url(url.replace("?cluster=1", "").replace("&cluster=1", ""),
                                            decode_responses=True, socket_timeout=10.0)
    else:
        # its own connection: the stream read blocks longer than the store's operation timeout
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=10.0)
    mirror = RedisResidencyMirror(client, keys=KeySpace(config.store.key_prefix))
    svc = ResidencyService(mirror, "redis")
    svc.mirror = mirror
    mirror.start()
    svc._closers.append(client.aclose)
    svc._closers.append(mirror.close)
    _attach(store, mirror)
    return svc


def _attach(store: StateStore, view: ResidencyView) -> None:
    if not hasattr(store, "residency"):
        log.warning("kv events: the store %s cannot carry residency", type(store).__name__)
        return
    store.residency = view


def with_session_id(body: bytes, session_id: str) -> bytes:
    """``body`` (a JSON object) with ``"session_id"`` added first, so SGLang attributes the KV blocks
    the request stores to the session (``BlockStored.session_id``). Unchanged when the body already
    names a ``session_id`` (the client's wins) or uses ``session_params`` (SGLang refuses both), or
    is not an object. Costs one copy of the body, no parse."""
    return with_first_field(body, "session_id", session_id, (b'"session_id"', b'"session_params"'))
