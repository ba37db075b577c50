"""``kvroute sidecar``: runs beside an engine in its pod and keeps it in the fleet's registry.

Lifecycle (one :class:`Agent`)::

    WAITING_ENGINE --/health 200--> REGISTERED <--> ENGINE_DOWN
                                        |  SIGTERM or POST /drain
                                        v
                                     DRAINING --in-flight 0 for drain_grace_s, or drain_timeout_s--> DRAINED

- WAITING_ENGINE: polls the engine's ``/health``; then reads ``/server_info`` (+ ``/model_info``) for
  capacity, TP and HiCache, and registers the replica (advertised URL, model, capacity, TP).
  A new replica starts as ``joining``; the gateways promote it after their first good health check.
- REGISTERED: every ``heartbeat_interval_s`` reads the engine's load (``EngineProbe.load``:
  ``/v1/loads``, ``/metrics`` now and then, as the gateways' discovery) and heartbeats the registry with
  the load (running, queued, KV utilisation, cache hit rate, host-tier use); the heartbeat refreshes
  the registry TTL, so a sidecar that dies leaves no entry behind. A beat waits for the scrape at most
  (``replica_ttl_s`` - ``heartbeat_interval_s``) / 2, then refreshes the entry with the last known load
  (a slow engine must not let its entry expire). ``/health`` (or the deeper ``/health_generate``) is
  checked every ``health_interval_s`` in a task of its own; ``unhealthy_after`` failures in a row
  withdraw the replica from the registry (ENGINE_DOWN), a good check registers it again (``joining``).
- DRAINING: marks the replica ``draining`` (gateways send it no new sessions and move its sessions at
  their next turn), keeps heartbeating, waits until its in-flight count is 0 (the registry's exact
  count over all gateways; the engine's running+queued when the registry cannot tell), then
  deregisters and exits 0.

Registries (:class:`Registrar`): the shared Redis registry through ``RedisStore``
(:class:`StoreRegistrar`, ``--redis``), or the gateways' admin API (:class:`AdminRegistrar`,
``--gateway URL --admin-token T``) when there is no Redis.

Probe server: ``GET /healthz`` (process alive and its loop ticking), ``GET /readyz`` (engine healthy
and registered, not draining), ``POST /drain[?wait=SECONDS]`` (start draining; with ``wait``, answer
when drained: a Kubernetes ``preStop`` hook of the engine container calls it so the engine outlives its
in-flight requests), ``GET /status`` (JSON).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any, Protocol

import aiohttp
from aiohttp import web

from replica.config import AgentConfig, load_config
from replica.probe import EngineProbe, EngineProbeError, build_spec, engine_info_from
from router.clock import Clock, SystemClock
from router.errors import ConfigError, KvrouteError, StoreError, error_body
from router.eventloop import stop_tasks
from router.model import EngineLoad, HealthStamp, ReplicaId, ReplicaSpec, ReplicaStatus
from router.store.base import StateStore

__all__ = [
    "AdminRegistrar",
    "Agent",
    "AgentPhase",
    "AgentStatus",
    "Registrar",
    "RegistrationError",
    "StoreRegistrar",
    "cli_main",
    "make_probe_app",
    "run_sidecar",
]

log = logging.getLogger("kvroute.sidecar")


class RegistrationError(KvrouteError):
    """The registry (Redis or every gateway's admin API) did not accept a write."""


class AgentPhase(StrEnum):
    WAITING_ENGINE = "waiting_engine"
    REGISTERED = "registered"
    ENGINE_DOWN = "engine_down"
    DRAINING = "draining"
    DRAINED = "drained"


@dataclass(frozen=True, slots=True)
class AgentStatus:
    """What ``GET /status`` shows."""

    phase: AgentPhase
    replica_id: str
    spec: ReplicaSpec | None
    load: EngineLoad | None
    last_heartbeat_ok_at: float | None
    heartbeats_ok: int
    heartbeats_failed: int
    health_failures_in_row: int
    in_flight: int | None
    drain_started_at: float | None
    drain_timed_out: bool

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["phase"] = self.phase.value
        return doc


# ---- registries ------------------------------------------------------------------------------------


class Registrar(Protocol):
    async def register(self, spec: ReplicaSpec) -> None:
        """Create or refresh the entry; a new entry starts ``joining``, an existing one keeps its status."""
        ...

    async def heartbeat(
        self, spec: ReplicaSpec, load: EngineLoad | None, status: ReplicaStatus | None
    ) -> None:
        """Refresh the entry's TTL and report load; ``status`` (if given) is re-asserted."""
        ...

    async def set_status(self, spec: ReplicaSpec, status: ReplicaStatus) -> None: ...

    async def in_flight(self, replica_id: ReplicaId) -> int | None:
        """Requests in flight on the replica through all gateways; ``None`` = the registry cannot tell."""
        ...

    async def deregister(self, replica_id: ReplicaId) -> None: ...

    async def share_health(self, replica_id: ReplicaId, stamp: HealthStamp) -> None:
        """A good check of the engine, shared with the gateways so that they need not repeat it
        (discovery rule 7); a registry that cannot share it ignores it."""
        ...

    async def close(self) -> None: ...


class StoreRegistrar:
    """Registry = a ``StateStore`` (``RedisStore`` in production; TTL on ``source="registry"``)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    @staticmethod
    @contextlib.asynccontextmanager
    async def _mapped(what: str) -> AsyncIterator[None]:
        try:
            yield
        except StoreError as exc:
            raise RegistrationError(f"{what}: {exc}") from exc

    async def register(self, spec: ReplicaSpec) -> None:
        async with self._mapped("register"):
            await self.store.upsert_replica(spec)

    def _degraded(self) -> bool:
        """``RedisStore`` keeps serving from a local mirror while Redis is away (and replays registry
        writes when it returns): for a sidecar that means the fleet does not see it right now."""
        return bool(getattr(self.store, "degraded", False))

    async def heartbeat(
        self, spec: ReplicaSpec, load: EngineLoad | None, status: ReplicaStatus | None
    ) -> None:
        async with self._mapped("heartbeat"):
            # upsert refreshes the TTL and re-creates an entry that expired (e.g. Redis restarted)
            await self.store.upsert_replica(spec, status)
            if load is not None:
                await self.store.report_engine_load(spec.id, load)
        if self._degraded():
            raise RegistrationError("heartbeat: registry unreachable (queued for replay)")

    async def set_status(self, spec: ReplicaSpec, status: ReplicaStatus) -> None:
        async with self._mapped("set_status"):
            await self.store.upsert_replica(spec, status)

    async def in_flight(self, replica_id: ReplicaId) -> int | None:
        if self._degraded():
            return None  # the local mirror does not know other gateways' requests
        async with self._mapped("in_flight"):
            for r in await self.store.replicas():
                if r.id == replica_id:
                    return r.in_flight
        return None  # no entry (expired, removed): ask the engine instead

    async def deregister(self, replica_id: ReplicaId) -> None:
        async with self._mapped("deregister"):
            await self.store.remove_replica(replica_id)

    async def share_health(self, replica_id: ReplicaId, stamp: HealthStamp) -> None:
        async with self._mapped("share_health"):
            await self.store.report_health({replica_id: stamp})

    async def close(self) -> None:
        await self.store.close()


class AdminRegistrar:
    """Registry = each gateway's admin API (no Redis). Every gateway is told; one success is enough."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        gateways: Sequence[str],
        token: str | None,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        if not gateways:
            raise ValueError("AdminRegistrar needs at least one gateway URL")
        self._session = session
        self._gateways = tuple(g.rstrip("/") for g in gateways)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, gw: str, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        async with self._session.request(
            method, gw + path, json=body, headers=self._headers, timeout=self._timeout
        ) as r:
            raw = await r.read()
            if r.status == 404 and method == "DELETE":
                return None
            if r.status >= 300:
                raise RegistrationError(f"{method} {gw}{path}: HTTP {r.status}: {raw[:200]!r}")
            return json.loads(raw) if raw else None

    async def _all(
        self, what: str, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Call every gateway; return the answers of those that succeeded (raise if none did)."""

        async def one(gw: str) -> Any:
            try:
                return await self._call(gw, method, path, body)
            except (TimeoutError, aiohttp.ClientError, OSError, json.JSONDecodeError) as exc:
                raise RegistrationError(f"{what} via {gw}: {type(exc).__name__}: {exc}") from exc

        results = await asyncio.gather(*(one(g) for g in self._gateways), return_exceptions=True)
        ok = [r for r in results if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        for e in errors:
            if not isinstance(e, RegistrationError):
                raise e
            log.warning("registry write failed", extra={"what": what, "error": str(e)})
        if not ok:
            raise RegistrationError(f"{what}: no gateway accepted ({errors[0] if errors else 'none'})")
        return ok

    @staticmethod
    def _body(spec: ReplicaSpec, status: ReplicaStatus | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": spec.id,
            "url": spec.url,
            "model": spec.model,
            "capacity_tokens": spec.capacity_tokens,
            "host_capacity_tokens": spec.host_capacity_tokens,
            "tp_size": spec.tp_size,
        }
        if spec.dp_rank is not None:
            body["dp_rank"] = spec.dp_rank
        if status is not None:
            body["status"] = status.value
        return body

    async def register(self, spec: ReplicaSpec) -> None:
        await self._all("register", "POST", "/admin/replicas", self._body(spec, None))

    async def heartbeat(
        self, spec: ReplicaSpec, load: EngineLoad | None, status: ReplicaStatus | None
    ) -> None:
        # The gateways scrape the engine's /metrics themselves in this mode; the heartbeat re-asserts
        # the entry so that a restarted gateway (memory store) learns the replica again.
        await self._all("heartbeat", "POST", "/admin/replicas", self._body(spec, status))

    async def set_status(self, spec: ReplicaSpec, status: ReplicaStatus) -> None:
        if status is ReplicaStatus.DRAINING:
            await self._all("drain", "POST", f"/admin/replicas/{spec.id}/drain", {})
        else:
            await self._all("set_status", "POST", "/admin/replicas", self._body(spec, status))

    async def in_flight(self, replica_id: ReplicaId) -> int | None:
        try:
            answers = await self._all("in_flight", "GET", "/admin/replicas")
        except RegistrationError:
            return None
        total = 0
        seen = False
        for doc in answers:
            items = doc.get("replicas", []) if isinstance(doc, dict) else doc
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and item.get("id") == replica_id:
                    n = item.get("in_flight")
                    if isinstance(n, int):
                        total += n
                        seen = True
        # Each gateway (memory store) counts its own requests: the sum is the replica's in-flight.
        return total if seen else None

    async def deregister(self, replica_id: ReplicaId) -> None:
        await self._all("deregister", "DELETE", f"/admin/replicas/{replica_id}")

    async def share_health(self, replica_id: ReplicaId, stamp: HealthStamp) -> None:
        return None  # each gateway keeps its own store in this mode, and checks for itself

    async def close(self) -> None:
        return None


# ---- the agent -------------------------------------------------------------------------------------


class Agent:
    """The sidecar's state machine. I/O only through ``probe``, ``registrar`` and ``clock``."""

    def __init__(
        self,
        cfg: AgentConfig,
        registrar: Registrar,
        probe: EngineProbe,
        clock: Clock | None = None,
        *,
        source: str = "registry",
    ) -> None:
        self.cfg = cfg
        self.registrar = registrar
        self.probe = probe
        self.clock = clock or SystemClock()
        self._source = source
        self._drain = asyncio.Event()
        self._engine_answering = False  # the last /metrics scrape succeeded (busy vs dead)
        self._drained = asyncio.Event()
        # Engine probes run as tasks of their own, so that an engine answering near the probe
        # timeout never holds back the registry refresh (the TTL is as short as that timeout).
        self._scrape_task: asyncio.Task[EngineLoad | None] | None = None
        self._scrape_started = 0.0
        self._health_task: asyncio.Task[None] | None = None
        # Every registry write of the loop (heartbeats, the health check's withdraw/rejoin, drain)
        # holds this lock, so a background write never interleaves with a beat's.
        self._registry_lock = asyncio.Lock()
        self._status = AgentStatus(
            phase=AgentPhase.WAITING_ENGINE,
            replica_id=cfg.id,
            spec=None,
            load=None,
            last_heartbeat_ok_at=None,
            heartbeats_ok=0,
            heartbeats_failed=0,
            health_failures_in_row=0,
            in_flight=None,
            drain_started_at=None,
            drain_timed_out=False,
        )
        self.last_tick = self.clock.now()

    # ---- observers (probe server) ----

    @property
    def status(self) -> AgentStatus:
        return self._status

    def _set(self, **changes: Any) -> None:
        self._status = replace(self._status, **changes)

    def alive(self) -> bool:
        """The loop is ticking (liveness): not stuck for longer than a few probe timeouts."""
        budget = max(30.0, 3 * self.cfg.probe_timeout_s + 3 * self.cfg.heartbeat_interval_s)
        return self.clock.now() - self.last_tick < budget

    def ready(self) -> bool:
        s = self._status
        if s.phase is not AgentPhase.REGISTERED or s.last_heartbeat_ok_at is None:
            return False
        return self.clock.now() - s.last_heartbeat_ok_at < self.cfg.replica_ttl_s

    def request_drain(self) -> None:
        if not self._drain.is_set():
            log.info("drain requested", extra={"replica": self.cfg.id})
        self._drain.set()

    async def wait_drained(self, timeout_s: float | None = None) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self._drained.wait()
        except TimeoutError:
            return False
        return True

    # ---- the loop ----

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when a drain is requested."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, seconds)):
                await self._drain.wait()

    async def run(self) -> int:
        try:
            spec = await self._wait_and_register()
            if spec is not None:
                spec = await self._heartbeat_loop(spec)
                await self._drain_and_deregister(spec)
            self._set(phase=AgentPhase.DRAINED)
            return 0
        finally:
            await self._cancel_probes()
            self._drained.set()

    async def _cancel_probes(self, *, scrape: bool = True) -> None:
        """Cancel the outstanding health check (and, with ``scrape``, the ``/metrics`` scrape)."""
        tasks = [self._health_task, self._scrape_task if scrape else None]
        self._health_task = None
        if scrape:
            self._scrape_task = None
        await stop_tasks(*tasks)

    async def _wait_and_register(self) -> ReplicaSpec | None:
        cfg = self.cfg
        started = self.clock.now()
        poll = min(1.0, cfg.heartbeat_interval_s)
        while not await self.probe.healthy():
            self.last_tick = self.clock.now()
            if self._drain.is_set():
                return None
            if cfg.engine_wait_timeout_s and self.clock.now() - started > cfg.engine_wait_timeout_s:
                raise EngineProbeError(
                    f"engine {cfg.engine_url} not healthy after {cfg.engine_wait_timeout_s}s"
                )
            await self._pause(poll)
        while True:  # the engine is up: learn what it is, then register (retrying both)
            self.last_tick = self.clock.now()
            if self._drain.is_set():
                return None
            try:
                server_info = await self.probe.server_info()
                dp = server_info.get("dp_size")
                if cfg.dp_rank is not None and type(dp) is int and not 0 <= cfg.dp_rank < dp:
                    # the engine would refuse every request named to that rank: register nothing
                    raise EngineProbeError(f"the engine has {dp} data-parallel rank(s), not rank {cfg.dp_rank} (--dp-rank)")
                try:
                    model_info: dict[str, Any] | None = await self.probe.model_info()
                except EngineProbeError:
                    model_info = None
                try:
                    load: EngineLoad | None = await self.probe.load(self.clock.now())
                except EngineProbeError:
                    load = None
                spec = build_spec(
                    replica_id=cfg.id,
                    url=cfg.advertised,
                    info=engine_info_from(server_info, model_info),
                    load=load,
                    model_override=cfg.model,
                    capacity_override=cfg.capacity_tokens,
                    host_capacity_override=cfg.host_capacity_tokens,
                    source=self._source,
                    dp_rank=cfg.dp_rank,
                )
                await self.registrar.register(spec)
                await self.registrar.heartbeat(spec, load, None)
            except (EngineProbeError, RegistrationError) as exc:
                log.warning("registration failed, retrying", extra={"error": str(exc)})
                await self._pause(poll)
                continue
            now = self.clock.now()
            self._set(
                phase=AgentPhase.REGISTERED,
                spec=spec,
                load=load,
                last_heartbeat_ok_at=now,
                heartbeats_ok=self._status.heartbeats_ok + 1,
            )
            log.info("registered", extra={"replica": spec.id, "spec": asdict(spec)})
            return spec

    async def _scrape(self) -> EngineLoad | None:
        """One reading of the engine's load; ``None`` when the engine did not answer (in time, or sensibly)."""
        try:
            load = await self.probe.load(self.clock.now())
        except EngineProbeError as exc:
            log.debug("metrics scrape failed", extra={"error": str(exc)})
            self._engine_answering = False
            return None
        self._engine_answering = True
        return load

    def _scrape_wait_s(self) -> float:
        """How long a beat waits for the scrape: half the slack between the TTL and the beat, so
        that a beat which waits this long, and the next one, both land inside the entry's TTL."""
        return max(0.0, (self.cfg.replica_ttl_s - self.cfg.heartbeat_interval_s) / 2)

    async def _beat(self, spec: ReplicaSpec, status: ReplicaStatus | None) -> EngineLoad | None:
        """Heartbeat the registry once, with a fresh load if the engine answers within
        :meth:`_scrape_wait_s`, else with the last known one (a late scrape keeps running; the next
        beat reports it). A beat of the REGISTERED phase (``status`` None) writes nothing once the
        replica was withdrawn meanwhile. Never raises."""
        task = self._scrape_task
        if task is not None and task.done() and self.clock.now() - self._scrape_started > self.cfg.replica_ttl_s:
            task = None  # finished long ago (no beats while withdrawn): too old to report
        if task is None:
            self._scrape_started = self.clock.now()
            task = self._scrape_task = asyncio.get_running_loop().create_task(
                self._scrape(), name="kvroute-sidecar-scrape"
            )
        await asyncio.wait({task}, timeout=self._scrape_wait_s())
        fresh = task.done()
        load: EngineLoad | None = None
        if fresh:
            self._scrape_task = None
            load = task.result()
        else:
            log.debug("engine /metrics is slow: heartbeat with the last known load")
        async with self._registry_lock:
            if status is None and self._status.phase is not AgentPhase.REGISTERED:
                return load  # withdrawn by the health check while this beat waited
            try:
                await self.registrar.heartbeat(spec, load if fresh else self._status.load, status)
            except RegistrationError as exc:
                log.warning("heartbeat failed", extra={"error": str(exc)})
                self._set(heartbeats_failed=self._status.heartbeats_failed + 1, load=load or self._status.load)
                return load
        self._set(
            last_heartbeat_ok_at=self.clock.now(),
            heartbeats_ok=self._status.heartbeats_ok + 1,
            load=load or self._status.load,
        )
        return load

    async def _heartbeat_loop(self, spec: ReplicaSpec) -> ReplicaSpec:
        cfg = self.cfg
        next_health = self.clock.now() + cfg.health_interval_s
        while not self._drain.is_set():
            tick = self.clock.now()
            self.last_tick = tick
            health = self._health_task
            if health is not None and health.done():
                self._health_task = None
                health.result()  # a bug in the check surfaces here, as it did when awaited inline
            if tick >= next_health and self._health_task is None:
                # in the background: a /health answering late must not delay the heartbeat
                next_health = tick + cfg.health_interval_s
                self._health_task = asyncio.get_running_loop().create_task(
                    self._check_health(spec), name="kvroute-sidecar-health"
                )
            if self._status.phase is AgentPhase.REGISTERED:
                await self._beat(spec, None)
            await self._pause(cfg.heartbeat_interval_s - (self.clock.now() - tick))
        # draining: a health check still in flight must not rejoin (or withdraw) the replica now
        await self._cancel_probes(scrape=False)
        return spec

    async def _check_health(self, spec: ReplicaSpec) -> None:
        """Deep health of the engine. A broken engine *leaves* the registry (rather than being marked
        down) so that the gateways' own, shallower health checks cannot readmit it while the sidecar
        knows better; it re-registers (as ``joining``) once healthy again."""
        outcome = await self.probe.health()
        ok = outcome == "ok"
        if outcome == "timeout" and self._engine_answering:
            # busy, not dead: /health waits behind the scheduler's work, yet the engine's HTTP
            # server still answered the last /metrics scrape. A wedged front end fails both.
            log.info("engine /health timed out while its /metrics answers: busy, kept")
            return
        fails = 0 if ok else self._status.health_failures_in_row + 1
        self._set(health_failures_in_row=fails)
        async with self._registry_lock:  # runs beside the beats (its own task): one write at a time
            phase = self._status.phase
            try:
                if not ok and fails >= self.cfg.unhealthy_after and phase is AgentPhase.REGISTERED:
                    log.warning("engine unhealthy: withdrawing the replica", extra={"replica": spec.id})
                    self._set(phase=AgentPhase.ENGINE_DOWN)
                    await self.registrar.deregister(spec.id)
                elif ok and phase is AgentPhase.ENGINE_DOWN:
                    log.info("engine healthy again: rejoining", extra={"replica": spec.id})
                    await self.registrar.register(spec)
                    self._set(phase=AgentPhase.REGISTERED)
                elif ok and phase is AgentPhase.REGISTERED:
                    # the next check is due within one interval (plus its own time): vouch for two
                    stamp = HealthStamp(self.clock.now(), f"sidecar:{spec.id}", 2 * self.cfg.health_interval_s)
                    await self.registrar.share_health(spec.id, stamp)
            except RegistrationError as exc:
                log.warning(
                    "registry change not recorded (retried at the next check)", extra={"error": str(exc)}
                )
                if phase is AgentPhase.REGISTERED and self._status.phase is AgentPhase.ENGINE_DOWN:
                    self._set(phase=AgentPhase.REGISTERED, health_failures_in_row=fails)

    async def _drain_and_deregister(self, spec: ReplicaSpec) -> None:
        cfg = self.cfg
        started = self.clock.now()
        self._set(phase=AgentPhase.DRAINING, drain_started_at=started)
        log.info("draining", extra={"replica": spec.id, "timeout_s": cfg.drain_timeout_s})
        marked = False
        quiet_since: float | None = None
        poll = min(0.25, cfg.heartbeat_interval_s)
        next_beat = started
        while True:
            now = self.clock.now()
            self.last_tick = now
            if not marked:
                try:
                    async with self._registry_lock:
                        await self.registrar.set_status(spec, ReplicaStatus.DRAINING)
                    marked = True
                except RegistrationError as exc:
                    log.warning("could not mark draining, retrying", extra={"error": str(exc)})
            if now >= next_beat:  # keep the entry alive (TTL) and visibly draining
                next_beat = now + cfg.heartbeat_interval_s
                await self._beat(spec, ReplicaStatus.DRAINING)
            n = await self._in_flight(spec.id)
            self._set(in_flight=n)
            now = self.clock.now()
            if marked and n == 0:
                quiet_since = quiet_since if quiet_since is not None else now
                if now - quiet_since >= cfg.drain_grace_s:
                    break
            else:
                quiet_since = None
            if now - started >= cfg.drain_timeout_s:
                log.warning("drain timed out", extra={"replica": spec.id, "in_flight": n})
                self._set(drain_timed_out=True)
                break
            await asyncio.sleep(poll)
        for attempt in range(5):
            try:
                async with self._registry_lock:
                    await self.registrar.deregister(spec.id)
                break
            except RegistrationError as exc:
                log.warning("deregister failed", extra={"error": str(exc), "attempt": attempt})
                await asyncio.sleep(poll)
        log.info("drained", extra={"replica": spec.id, "seconds": self.clock.now() - started})

    async def _in_flight(self, replica_id: ReplicaId) -> int:
        """The registry's exact count; the engine's running+queued when the registry cannot tell."""
        try:
            n = await self.registrar.in_flight(replica_id)
        except RegistrationError:
            n = None
        if n is not None:
            return n
        try:
            load = await self.probe.load(self.clock.now())
        except EngineProbeError:
            return 0  # engine gone: nothing left to finish
        return load.running + load.queued


# ---- probe server ----------------------------------------------------------------------------------

AGENT_KEY: web.AppKey[Agent] = web.AppKey("agent", Agent)


def _json(status: int, doc: Mapping[str, Any]) -> web.Response:
    return web.json_response(doc, status=status, dumps=lambda o: json.dumps(o, default=str))


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return _json(status, error_body(message, kind, code))


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(404, f"no route {request.path}", "not_found")
    except web.HTTPMethodNotAllowed:
        return _error(405, f"method {request.method} not allowed on {request.path}", "method_not_allowed")


async def _healthz(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    if agent.alive():
        return _json(200, {"status": "alive", "phase": agent.status.phase.value})
    return _error(503, "sidecar loop is stuck", "stuck")


async def _readyz(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    if agent.ready():
        return _json(200, {"status": "ready", "replica": agent.status.replica_id})
    return _error(503, f"not ready: {agent.status.phase.value}", agent.status.phase.value)


async def _status(request: web.Request) -> web.Response:
    return _json(200, request.app[AGENT_KEY].status.to_json())


async def _drain(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    raw = request.query.get("wait", "0")
    try:
        wait_s = float(raw)
    except ValueError:
        return _error(400, f"wait must be a number of seconds, got {raw!r}", "bad_request")
    if not 0 <= wait_s <= 86400:
        return _error(400, "wait must be in [0, 86400]", "bad_request")
    agent.request_drain()
    if wait_s > 0:
        await agent.wait_drained(wait_s)
    phase = agent.status.phase
    return _json(200 if phase is AgentPhase.DRAINED else 202, {"phase": phase.value})


def make_probe_app(agent: Agent) -> web.Application:
    app = web.Application(middlewares=[_json_errors])
    app[AGENT_KEY] = agent
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/status", _status)
    app.router.add_post("/drain", _drain)
    return app


# ---- shell -----------------------------------------------------------------------------------------


def _make_redis_registrar(cfg: AgentConfig, clock: Clock) -> Registrar:
    from router.store.base import StoreConfig
    from router.store.redis import RedisStore

    store = RedisStore.from_url(
        cfg.redis_url or "",
        gateway_id=f"sidecar-{cfg.id}".replace("|", "_"),
        config=StoreConfig(replica_ttl_s=cfg.replica_ttl_s, key_prefix=cfg.key_prefix),
        clock=clock,
    )
    return StoreRegistrar(store)


async def run_sidecar(
    cfg: AgentConfig,
    *,
    clock: Clock | None = None,
    on_listening: Callable[[int], None] | None = None,
    install_signals: bool = True,
) -> int:
    """Run the sidecar until drained (SIGTERM/SIGINT or ``POST /drain``)."""
    clock = clock or SystemClock()
    connector = aiohttp.TCPConnector(limit=16)
    async with aiohttp.ClientSession(connector=connector) as session:
        registrar: Registrar
        if cfg.redis_url:
            registrar = _make_redis_registrar(cfg, clock)
            source = "registry"
        else:
            registrar = AdminRegistrar(session, cfg.gateways, cfg.admin_token, timeout_s=cfg.probe_timeout_s)
            source = "admin"
        probe = EngineProbe(
            session, cfg.engine_url, timeout_s=cfg.probe_timeout_s, health_path=cfg.health_path, dp_rank=cfg.dp_rank
        )
        agent = Agent(cfg, registrar, probe, clock, source=source)
        kv_task = None
        if cfg.kv_events and isinstance(registrar, StoreRegistrar):
            kv_task = asyncio.get_running_loop().create_task(
                _share_residency(cfg, session, registrar.store), name="kvroute-sidecar-kv-events"
            )
        runner = web.AppRunner(make_probe_app(agent), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.listen_host, cfg.listen_port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else cfg.listen_port
        if on_listening is not None:
            on_listening(port)
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, agent.request_drain)
        try:
            return await agent.run()
        finally:
            if install_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            await stop_tasks(kv_task)
            await runner.cleanup()
            await registrar.close()


async def _share_residency(cfg: AgentConfig, session: aiohttp.ClientSession, store: StateStore) -> None:
    """Follow this engine's KV events and write its exact residency to Redis, for the gateways in
    ``kv_events.mode: redis`` (router/store/residency.py). Runs until cancelled."""
    from router.kv_events import KvEventsManager
    from router.residency import ResidencyIndex
    from router.store.residency import RedisResidencyWriter

    client = getattr(store, "client", None)
    if client is None:
        log.warning("--kv-events: the registry is not Redis; residency is not shared")
        return

    async def server_info(rid: str, url: str) -> dict[str, Any] | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=cfg.probe_timeout_s)) as r:
                if r.status != 200:
                    return None
                body = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return body if isinstance(body, dict) else None

    index = ResidencyIndex(track_changes=True)
    manager = KvEventsManager(index, server_info)
    writer = RedisResidencyWriter(client, index, keys=getattr(store, "keys", None), writer_id=f"sidecar-{cfg.id}")
    flush = asyncio.get_running_loop().create_task(writer.run(), name="kvroute-sidecar-residency-writer")
    try:
        while True:
            # the engine as this sidecar reaches it, under the replica id the gateways know
            await manager.refresh([(cfg.id, cfg.engine_url, cfg.dp_rank)])
            await asyncio.sleep(5.0)
    finally:
        await stop_tasks(flush)
        await writer.close()
        await manager.close()


def cli_main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv, os.environ)
    except ConfigError as exc:
        print(f"kvroute sidecar: {exc}", file=sys.stderr)
        return 2
    level = os.environ.get("KVROUTE_LOG_LEVEL", "info")
    try:
        from router.observability.logging import configure_logging

        configure_logging(level, stream=sys.stderr)
    except ImportError:  # pragma: no cover - observability is part of the package
        logging.basicConfig(level=level.upper(), stream=sys.stderr)

    def listening(port: int) -> None:
        print(json.dumps({"event": "listening", "port": port, "replica": cfg.id}), flush=True)

    try:
        return asyncio.run(run_sidecar(cfg, on_listening=listening))
    except EngineProbeError as exc:
        print(f"kvroute sidecar: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
