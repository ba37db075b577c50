"""The replica sidecar agent, in-process on real sockets.

The engine here is a small controllable SGLang stand-in (its health, load and /server_info are set by
the test, its /metrics text is SGLang's exposition format) so that failure and drain transitions can
be driven exactly; ``test_agent_functional.py`` runs the real ``kvroute sidecar`` process against the
emulator and Redis.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replica.agent import (
    AdminRegistrar,
    Agent,
    AgentPhase,
    RegistrationError,
    StoreRegistrar,
    make_probe_app,
    run_sidecar,
)
from replica.config import AgentConfig, load_config, replica_id_for, validate
from replica.probe import EngineProbe, build_spec, engine_info_from
from router.clock import SystemClock
from router.config import HealthConfig, TimeoutsConfig
from router.discovery import Discovery
from router.errors import ConfigError
from router.gateway.upstream import ReplicaHttpClient
from router.model import (
    BindSession,
    Completion,
    EngineLoad,
    KeySource,
    Reason,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
)
from router.store.memory import MemoryStore

MODEL = "moonshotai/Kimi-K2.6"


def metrics_text(
    running: int, queued: int, kv: float, cap: int, host_used: int, host_total: int, chr_: float
) -> str:
    labels = f'engine_type="unified",model_name="{MODEL}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
    lines = []
    for name, value in [
        ("num_running_reqs", running),
        ("num_queue_reqs", queued),
        ("token_usage", kv),
        ("max_total_num_tokens", cap),
        ("hicache_host_used_tokens", host_used),
        ("hicache_host_total_tokens", host_total),
        ("cache_hit_rate", chr_),
    ]:
        lines += [
            f"# HELP sglang:{name} x",
            f"# TYPE sglang:{name} gauge",
            f"sglang:{name}{{{labels}}} {float(value)}",
        ]
    return "\n".join(lines) + "\n"


@dataclass
class FakeEngine:
    """SGLang stand-in: /health, /server_info, /model_info, /metrics (test-controlled values)."""

    healthy: bool = True
    running: int = 0
    queued: int = 0
    capacity: int = 446_744
    host_total: int = 893_488
    metrics_on: bool = True
    server_info: dict[str, Any] = field(
        default_factory=lambda: {
            "tp_size": 4,
            "max_total_num_tokens": 446_744,
            "enable_hierarchical_cache": True,
            "hicache_ratio": 2.0,
            "served_model_name": MODEL,
            "model_path": "nvidia/Kimi-K2.6-NVFP4",
            "version": "0.5.23",
        }
    )
    health_calls: int = 0
    health_delay_s: float = 0.0  # a busy SGLang answers /health late
    url: str = ""
    loads: list[dict[str, Any]] | None = None  # /v1/loads entries, one per data-parallel rank (None: 404)

    def app(self) -> web.Application:
        async def health(_: web.Request) -> web.Response:
            self.health_calls += 1
            if self.health_delay_s:
                await asyncio.sleep(self.health_delay_s)
            return web.Response(status=200 if self.healthy else 503)

        async def server_info(_: web.Request) -> web.Response:
            return web.json_response(self.server_info)

        async def model_info(_: web.Request) -> web.Response:
            return web.json_response({"model_path": "nvidia/Kimi-K2.6-NVFP4", "served_model_name": MODEL})

        async def metrics(_: web.Request) -> web.Response:
            if not self.metrics_on:
                return web.Response(status=404)
            text = metrics_text(self.running, self.queued, 0.25, self.capacity, 1000, self.host_total, 0.9)
            return web.Response(text=text, content_type="text/plain")

        async def v1_loads(request: web.Request) -> web.Response:
            if self.loads is None:
                return web.Response(status=404)
            ranks = [r for r in self.loads if str(r["dp_rank"]) == request.query.get("dp_rank", str(r["dp_rank"]))]
            return web.json_response({"version": "0.5.23", "loads": ranks})

        app = web.Application()
        app.router.add_get("/v1/loads", v1_loads)
        app.router.add_get("/health", health)
        app.router.add_get("/server_info", server_info)
        app.router.add_get("/model_info", model_info)
        app.router.add_get("/metrics", metrics)
        return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    eng = FakeEngine()
    runner, eng.url = await _serve(eng.app())
    yield eng
    await runner.cleanup()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def _cfg(engine_url: str, **kw: Any) -> AgentConfig:
    base = {
        "engine_url": engine_url,
        "gateways": ("http://127.0.0.1:1",),
        "heartbeat_interval_s": 0.05,
        "health_interval_s": 0.05,
        "replica_ttl_s": 2.0,
        "probe_timeout_s": 2.0,
        "unhealthy_after": 2,
        "drain_grace_s": 0.1,
        "drain_timeout_s": 10.0,
        "listen_port": 0,
    }
    base.update(kw)
    return validate(AgentConfig(**base))


async def _until(pred: Any, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        res = pred()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _replica(store: MemoryStore, rid: str) -> Any:
    for r in await store.replicas():
        if r.id == rid:
            return r
    return None


def _acquire_args(rid: str, sid: str) -> tuple[RouteDecision, RouteRequest]:
    decision = RouteDecision(
        replica_id=rid,
        reason=Reason.PLACED_NEW,
        effects=(BindSession(sid, rid, None, Reason.PLACED_NEW),),
    )
    return decision, RouteRequest(session_key=sid, key_source=KeySource.HEADER)


# ---- pure parts ------------------------------------------------------------------------------------


def test_engine_info_and_spec_from_server_info() -> None:
    info = engine_info_from(FakeEngine().server_info, {"served_model_name": "served"})
    assert (info.model, info.capacity_tokens, info.tp_size, info.hicache) == ("served", 446_744, 4, True)
    # without a scrape the host tier is estimated from hicache_ratio
    spec = build_spec(replica_id="r:1", url="http://r:1", info=info, load=None)
    assert spec.capacity_tokens == 446_744 and spec.host_capacity_tokens == 893_488
    assert spec.source == "registry" and spec.tp_size == 4
    # the engine's gauges win over /server_info, overrides win over both
    load = EngineLoad(capacity_tokens=400_000, host_capacity_tokens=1_000_000)
    spec = build_spec(replica_id="r:1", url="http://r:1", info=info, load=load)
    assert (spec.capacity_tokens, spec.host_capacity_tokens) == (400_000, 1_000_000)
    spec = build_spec(
        replica_id="r:1",
        url="u",
        info=info,
        load=load,
        capacity_override=7,
        host_capacity_override=9,
        model_override="m",
    )
    assert (spec.capacity_tokens, spec.host_capacity_tokens, spec.model) == (7, 9, "m")


def test_engine_info_old_servers_and_missing_fields() -> None:
    info = engine_info_from(
        {"internal_states": [{"max_total_num_tokens": 100}, {"max_total_num_tokens": 50}], "model_path": "p"}
    )
    assert (info.capacity_tokens, info.model, info.tp_size, info.hicache) == (150, "p", 0, False)
    info = engine_info_from({"max_total_num_tokens": "junk", "tp_size": True})
    assert (info.capacity_tokens, info.tp_size) == (0, 0)
    assert build_spec(replica_id="x", url="u", info=info, load=None).host_capacity_tokens == 0


def test_config_precedence_and_validation() -> None:
    env = {
        "KVROUTE_SIDECAR_ENGINE_URL": "http://10.0.0.5:30000/",
        "KVROUTE_SIDECAR_REDIS_URL": "redis://127.0.0.1:6390/0",
        "KVROUTE_SIDECAR_HEARTBEAT_INTERVAL": "0.5",
        "KVROUTE_SIDECAR_GATEWAY": "http://a:1,http://b:2",
    }
    cfg = load_config(["--heartbeat-interval", "0.25", "--advertise-url", "http://pod-1.svc:30000"], env)
    assert cfg.engine_url == "http://10.0.0.5:30000"
    assert cfg.heartbeat_interval_s == 0.25  # flag beats env
    assert cfg.gateways == ("http://a:1", "http://b:2")
    assert cfg.id == "pod-1.svc:30000" == replica_id_for(cfg.advertised)
    assert cfg.redis_url == "redis://127.0.0.1:6390/0"
    ranked = load_config(["--dp-rank", "1"], {**env, "KVROUTE_SIDECAR_ADVERTISE_URL": "http://pod-1.svc:30000"})
    assert (ranked.dp_rank, ranked.id) == (1, "pod-1.svc:30000-dp1")
    assert load_config([], {**env, "KVROUTE_SIDECAR_DP_RANK": "3"}).dp_rank == 3
    assert load_config(["--dp-rank", "2", "--replica-id", "mine"], env).id == "mine"


@pytest.mark.parametrize(
    ("argv", "env", "match"),
    [
        ([], {}, "need a registry"),
        (["--gateway", "ftp://x"], {}, "--gateway"),
        (["--redis", "http://x"], {}, "--redis"),
        (["--redis", "redis://x", "--engine-url", "nope"], {}, "--engine-url"),
        (["--redis", "redis://x", "--replica-ttl", "1", "--heartbeat-interval", "1"], {}, "--replica-ttl"),
        (["--redis", "redis://x", "--heartbeat-interval", "0"], {}, "--heartbeat-interval"),
        (["--redis", "redis://x", "--unhealthy-after", "0"], {}, "--unhealthy-after"),
        (["--redis", "redis://x", "--replica-id", "a b"], {}, "--replica-id"),
        (["--redis", "redis://x"], {"KVROUTE_SIDECAR_BOGUS": "1"}, "KVROUTE_SIDECAR_BOGUS"),
        (["--redis", "redis://x", "--dp-rank", "-1"], {}, "--dp-rank"),
        (["--redis", "redis://x"], {"KVROUTE_SIDECAR_DP_RANK": "one"}, "KVROUTE_SIDECAR_DP_RANK"),
        (
            ["--redis", "redis://x"],
            {"KVROUTE_SIDECAR_DRAIN_TIMEOUT": "soon"},
            "KVROUTE_SIDECAR_DRAIN_TIMEOUT",
        ),
    ],
)
def test_config_errors_name_the_key(argv: list[str], env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(argv, env)


# ---- the agent with the memory store ---------------------------------------------------------------


async def test_waits_for_engine_then_registers_and_heartbeats(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.healthy = False
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(lambda: engine.health_calls >= 3, what="health polling")
    assert agent.status.phase is AgentPhase.WAITING_ENGINE and not agent.ready()
    assert await store.replicas() == ()

    engine.healthy = True
    engine.running, engine.queued = 3, 2
    await _until(agent.ready, what="registered")
    rep = await _replica(store, cfg.id)
    assert rep.status is ReplicaStatus.JOINING  # gateways promote it after their own health check
    assert rep.url == engine.url and rep.model == MODEL
    assert rep.capacity_tokens == 446_744 and rep.host_capacity_tokens == 893_488
    assert rep.engine.running == 3 and rep.engine.queued == 2 and rep.engine.cache_hit_rate == 0.9

    # heartbeats carry fresh load and keep the status the gateway set
    await store.set_status(cfg.id, ReplicaStatus.ACTIVE)
    engine.running = 7

    async def running_is_7() -> bool:
        r = await _replica(store, cfg.id)
        return r is not None and r.engine.running == 7

    await _until(running_is_7, what="load update")
    assert (await _replica(store, cfg.id)).status is ReplicaStatus.ACTIVE
    assert agent.status.heartbeats_ok >= 2
    agent.request_drain()
    assert await asyncio.wait_for(task, 10) == 0
    assert await _replica(store, cfg.id) is None


async def test_good_engine_checks_are_shared_with_the_gateways(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """Discovery rule 7: the sidecar shares each good check of its engine, vouching for two of its
    intervals, and a gateway's discovery on the same store then leaves the replica alone."""
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url, health_interval_s=0.5)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    try:
        await _until(agent.ready, what="registered")
        await store.set_status(cfg.id, ReplicaStatus.ACTIVE)

        async def shared() -> bool:
            return cfg.id in await store.health_stamps()

        await _until(shared, what="a shared check")
        stamp = (await store.health_stamps())[cfg.id]
        assert (stamp.by, stamp.fresh_s) == (f"sidecar:{cfg.id}", 1.0)
        assert SystemClock().now() - stamp.at < 1.0
        d = Discovery(store, client, HealthConfig(), clock=SystemClock(), emit=lambda e: None, rng=random.Random(1))
        await d.check_health_once()
        assert (d.health_shared, d.health_failures) == (1, 0)  # not checked: the sidecar's check stands
    finally:
        await client.close()
        agent.request_drain()
        assert await asyncio.wait_for(task, 10) == 0


async def test_unhealthy_engine_is_withdrawn_then_rejoins(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(agent.ready, what="registered")
    await store.set_status(cfg.id, ReplicaStatus.ACTIVE)

    engine.healthy = False

    async def gone() -> bool:
        return await _replica(store, cfg.id) is None

    await _until(gone, what="withdrawn")
    assert agent.status.phase is AgentPhase.ENGINE_DOWN and not agent.ready()
    assert agent.status.health_failures_in_row >= cfg.unhealthy_after
    await asyncio.sleep(0.3)  # no heartbeat brings it back while the engine is broken
    assert await gone()

    engine.healthy = True

    async def rejoined() -> bool:
        r = await _replica(store, cfg.id)
        return r is not None and r.status is ReplicaStatus.JOINING

    await _until(rejoined, what="rejoin")
    await _until(agent.ready, what="ready again")
    assert agent.status.phase is AgentPhase.REGISTERED
    agent.request_drain()
    assert await asyncio.wait_for(task, 10) == 0


async def test_busy_engine_is_kept_a_silent_one_withdrawn(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """/health timing out while /metrics answers is a busy engine: kept. Both silent: withdrawn."""
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url, probe_timeout_s=0.1)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url, timeout_s=0.1))
    task = asyncio.create_task(agent.run())
    await _until(agent.ready, what="registered")
    engine.health_delay_s = 0.3
    calls = engine.health_calls
    await _until(lambda: engine.health_calls >= calls + 6, what="several slow health checks")
    assert agent.status.phase is AgentPhase.REGISTERED and await _replica(store, cfg.id) is not None
    assert agent.status.health_failures_in_row == 0
    engine.metrics_on = False  # now /metrics fails too: nothing says the engine is alive

    async def gone() -> bool:
        return await _replica(store, cfg.id) is None

    await _until(gone, what="withdrawn")
    assert agent.status.phase is AgentPhase.ENGINE_DOWN
    agent.request_drain()
    assert await asyncio.wait_for(task, 10) == 0


async def test_drain_waits_for_in_flight_then_deregisters(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url, drain_grace_s=0.2)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(agent.ready, what="registered")
    await store.set_status(cfg.id, ReplicaStatus.ACTIVE)
    leases = [await store.acquire(*_acquire_args(cfg.id, f"s{i}")) for i in range(2)]

    agent.request_drain()

    async def draining() -> bool:
        r = await _replica(store, cfg.id)
        return r is not None and r.status is ReplicaStatus.DRAINING

    await _until(draining, what="draining")
    assert not agent.ready()
    await asyncio.sleep(0.5)  # well past the grace: still registered, 2 requests in flight
    assert not task.done() and agent.status.in_flight == 2
    assert await _replica(store, cfg.id) is not None
    await store.release(
        leases[0], Completion(ok=True, prompt_tokens=100, cached_tokens=0, completion_tokens=5)
    )
    await asyncio.sleep(0.3)
    assert not task.done()
    await store.release(
        leases[1], Completion(ok=True, prompt_tokens=100, cached_tokens=0, completion_tokens=5)
    )
    assert await asyncio.wait_for(task, 10) == 0
    assert await _replica(store, cfg.id) is None
    assert agent.status.phase is AgentPhase.DRAINED and not agent.status.drain_timed_out


async def test_drain_times_out(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url, drain_timeout_s=0.4)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(agent.ready, what="registered")
    await store.acquire(*_acquire_args(cfg.id, "stuck"))
    agent.request_drain()
    assert await asyncio.wait_for(task, 10) == 0
    assert agent.status.drain_timed_out
    assert await _replica(store, cfg.id) is None


class _NoCountRegistrar(StoreRegistrar):
    """A registry that cannot tell in-flight counts (forces the engine's running+queued)."""

    async def in_flight(self, replica_id: str) -> int | None:
        return None


async def test_drain_falls_back_to_engine_counts(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url)
    agent = Agent(cfg, _NoCountRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(agent.ready, what="registered")
    engine.running, engine.queued = 1, 1
    agent.request_drain()
    await _until(lambda: agent.status.in_flight == 2, what="engine count")
    await asyncio.sleep(0.3)
    assert not task.done()
    engine.running, engine.queued = 0, 0
    assert await asyncio.wait_for(task, 10) == 0
    assert await _replica(store, cfg.id) is None


async def test_drain_before_engine_is_up_exits_without_registering(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.healthy = False
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    task = asyncio.create_task(agent.run())
    await _until(lambda: engine.health_calls >= 1, what="polling")
    agent.request_drain()
    assert await asyncio.wait_for(task, 5) == 0
    assert await store.replicas() == ()


# ---- probe server ----------------------------------------------------------------------------------


async def test_probe_endpoints(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    store = MemoryStore(SystemClock())
    cfg = _cfg(engine.url)
    engine.healthy = False
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url))
    runner, url = await _serve(make_probe_app(agent))
    task = asyncio.create_task(agent.run())
    try:
        async with session.get(url + "/healthz") as r:
            assert r.status == 200 and (await r.json())["phase"] == "waiting_engine"
        async with session.get(url + "/readyz") as r:
            assert r.status == 503
            body = await r.json()
            assert set(body["error"]) == {"message", "type", "code"}
        engine.healthy = True
        await _until(agent.ready, what="ready")
        async with session.get(url + "/readyz") as r:
            assert r.status == 200 and (await r.json())["replica"] == cfg.id
        async with session.get(url + "/status") as r:
            st = await r.json()
            assert st["phase"] == "registered" and st["spec"]["capacity_tokens"] == 446_744
        async with session.get(url + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
        async with session.get(url + "/drain") as r:
            assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
        async with session.post(url + "/drain?wait=abc") as r:
            assert r.status == 400
        assert not task.done()
        # preStop-style: start the drain and wait for it
        async with session.post(url + "/drain?wait=10") as r:
            assert r.status == 200 and (await r.json())["phase"] == "drained"
        async with session.get(url + "/readyz") as r:
            assert r.status == 503
        assert await asyncio.wait_for(task, 5) == 0
    finally:
        await runner.cleanup()


# ---- the admin-API registry against the real admin app --------------------------------------------


async def _admin_gateway(store: MemoryStore, token: str) -> tuple[web.AppRunner, str]:
    from router.gateway.admin import AdminSettings, PolicyHolder, make_admin_app
    from router.observability.stats import RollingStats
    from router.policy.params import PolicyParams

    app = web.Application()
    app.add_subapp(
        "/admin",
        make_admin_app(
            store,
            PolicyHolder("kv_aware", PolicyParams()),
            RollingStats(),
            SystemClock(),
            AdminSettings(token=token),
        ),
    )
    return await _serve(app)


async def test_one_sidecar_per_data_parallel_rank_registers_each_rank_as_a_replica(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    """``--dp-rank R``: the rank is a replica of its own (``host:port-dpR``, the gateway's
    ``--replica-dp-ranks`` ids), with its own rank's load and capacity; draining one leaves the other."""
    engine.loads = [{"dp_rank": r, "num_running_reqs": 3 + r, "num_waiting_reqs": r, "max_total_num_tokens": 200_000,
                     "token_usage": 0.5, "cache_hit_rate": 0.9} for r in range(2)]  # fmt: skip
    store = MemoryStore(SystemClock())
    agents, tasks = [], []
    for rank in (0, 1):
        cfg = _cfg(engine.url, dp_rank=rank)
        assert cfg.id == f"{engine.url.removeprefix('http://')}-dp{rank}"
        agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url, dp_rank=rank))
        agents.append(agent)
        tasks.append(asyncio.create_task(agent.run()))
    for agent in agents:
        await _until(agent.ready, what="registered")
    reps = {r.id: r for r in await store.replicas()}
    got = {rid: (r.dp_rank, r.url, r.engine.running, r.engine.queued, r.capacity_tokens) for rid, r in reps.items()}
    assert got == {agents[r].cfg.id: (r, engine.url, 3 + r, r, 200_000) for r in (0, 1)}
    agents[1].request_drain()
    assert await asyncio.wait_for(tasks[1], 10) == 0
    assert [r.id for r in await store.replicas()] == [agents[0].cfg.id]
    agents[0].request_drain()
    assert await asyncio.wait_for(tasks[0], 10) == 0

    # a rank the engine does not have (its /server_info dp_size): nothing registered until it has it
    engine.server_info = {**engine.server_info, "dp_size": 2}
    cfg = _cfg(engine.url, dp_rank=2)
    agent = Agent(cfg, StoreRegistrar(store), EngineProbe(session, cfg.engine_url, dp_rank=2))
    task = asyncio.create_task(agent.run())
    await asyncio.sleep(0.5)  # ten heartbeat intervals
    assert not agent.ready() and await store.replicas() == ()
    engine.server_info = {**engine.server_info, "dp_size": 3}
    engine.loads.append({**engine.loads[0], "dp_rank": 2})
    await _until(agent.ready, what="registered once the engine has the rank")
    assert [(r.id, r.dp_rank) for r in await store.replicas()] == [(cfg.id, 2)]
    agent.request_drain()
    assert await asyncio.wait_for(task, 10) == 0


async def test_admin_registrar_against_the_admin_api(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    stores = [MemoryStore(SystemClock()), MemoryStore(SystemClock())]
    gateways = [await _admin_gateway(s, "sekret") for s in stores]
    try:
        cfg = _cfg(engine.url, gateways=tuple(u for _, u in gateways), admin_token="sekret")
        registrar = AdminRegistrar(session, cfg.gateways, cfg.admin_token)
        agent = Agent(cfg, registrar, EngineProbe(session, cfg.engine_url), source="admin")
        task = asyncio.create_task(agent.run())
        await _until(agent.ready, what="registered")
        for store in stores:  # every gateway learned the replica
            rep = await _replica(store, cfg.id)
            assert rep is not None and rep.status is ReplicaStatus.JOINING and rep.capacity_tokens == 446_744
            await store.set_status(cfg.id, ReplicaStatus.ACTIVE)
        # one request in flight through each gateway: the sidecar sums them
        leases = [await s.acquire(*_acquire_args(cfg.id, f"s{i}")) for i, s in enumerate(stores)]
        agent.request_drain()

        async def all_draining() -> bool:
            reps = [await _replica(s, cfg.id) for s in stores]
            return all(r is not None and r.status is ReplicaStatus.DRAINING for r in reps)

        await _until(all_draining, what="drain on every gateway")
        await _until(lambda: agent.status.in_flight == 2, what="summed in-flight")
        await stores[0].release(leases[0], Completion(ok=True))
        await _until(lambda: agent.status.in_flight == 1, what="one left")
        assert not task.done()
        await stores[1].release(leases[1], Completion(ok=True))
        assert await asyncio.wait_for(task, 10) == 0
        for store in stores:
            assert await _replica(store, cfg.id) is None
    finally:
        for runner, _ in gateways:
            await runner.cleanup()


async def test_admin_registrar_wrong_token_is_an_error(session: aiohttp.ClientSession) -> None:
    store = MemoryStore(SystemClock())
    runner, url = await _admin_gateway(store, "right")
    try:
        from router.model import ReplicaSpec

        reg = AdminRegistrar(session, [url], "wrong")
        with pytest.raises(RegistrationError, match="401"):
            await reg.register(ReplicaSpec(id="127.0.0.1:9", url="http://127.0.0.1:9"))
        assert await store.replicas() == ()
        # one dead gateway among live ones is tolerated; all dead is an error
        good = AdminRegistrar(session, [url, "http://127.0.0.1:1"], "right")
        await good.register(ReplicaSpec(id="127.0.0.1:9", url="http://127.0.0.1:9"))
        assert len(await store.replicas()) == 1
        with pytest.raises(RegistrationError):
            await AdminRegistrar(session, ["http://127.0.0.1:1"], "right").register(
                ReplicaSpec(id="x:1", url="http://127.0.0.1:9")
            )
    finally:
        await runner.cleanup()


async def test_run_sidecar_serves_probes_and_drains(engine: FakeEngine) -> None:
    """The assembled shell (admin registry, probe server on port 0), drained through POST /drain."""
    store = MemoryStore(SystemClock())
    gw_runner, gw = await _admin_gateway(store, "t")
    ports: list[int] = []
    cfg = _cfg(engine.url, gateways=(gw,), admin_token="t", listen_host="127.0.0.1")
    task = asyncio.create_task(run_sidecar(cfg, on_listening=ports.append, install_signals=False))
    try:
        await _until(lambda: bool(ports), what="listening")
        async with aiohttp.ClientSession() as s:

            async def ready() -> bool:
                async with s.get(f"http://127.0.0.1:{ports[0]}/readyz") as r:
                    return r.status == 200

            await _until(ready, what="ready")
            assert (await _replica(store, cfg.id)) is not None
            async with s.post(f"http://127.0.0.1:{ports[0]}/drain?wait=5") as r:
                assert json.loads(await r.text())["phase"] == "drained"
        assert await asyncio.wait_for(task, 5) == 0
        assert await store.replicas() == ()
    finally:
        await gw_runner.cleanup()


# ---- the Redis registry (real redis-server) --------------------------------------------------------


async def test_redis_registry_register_heartbeat_ttl_and_drain(
    engine: FakeEngine, session: aiohttp.ClientSession, redis_url: str
) -> None:
    from router.store.base import StoreConfig
    from router.store.redis import RedisStore

    cfg = _cfg(engine.url, redis_url=redis_url, gateways=(), replica_ttl_s=1.0, heartbeat_interval_s=0.1)
    sidecar_store = RedisStore.from_url(
        redis_url, gateway_id="sidecar-t", config=StoreConfig(replica_ttl_s=1.0)
    )
    gateway = RedisStore.from_url(redis_url, gateway_id="gw-t", config=StoreConfig(replica_ttl_s=1.0))
    try:
        engine.running = 4
        agent = Agent(cfg, StoreRegistrar(sidecar_store), EngineProbe(session, cfg.engine_url))
        task = asyncio.create_task(agent.run())
        await _until(agent.ready, what="registered")

        async def seen_by_gateway() -> bool:
            r = await _replica(gateway, cfg.id)  # type: ignore[arg-type]
            return r is not None and r.engine.running == 4

        await _until(seen_by_gateway, what="gateway sees the replica and its load")
        rep = await _replica(gateway, cfg.id)  # type: ignore[arg-type]
        assert rep.status is ReplicaStatus.JOINING and rep.capacity_tokens == 446_744
        await gateway.set_status(cfg.id, ReplicaStatus.ACTIVE)
        # heartbeats keep the entry alive well past its 1 s TTL
        await asyncio.sleep(1.5)
        rep = await _replica(gateway, cfg.id)  # type: ignore[arg-type]
        assert rep is not None and rep.status is ReplicaStatus.ACTIVE
        # a request in flight through the *gateway's* store holds the drain
        lease = await gateway.acquire(*_acquire_args(cfg.id, "s1"))
        agent.request_drain()

        async def draining() -> bool:
            r = await _replica(gateway, cfg.id)  # type: ignore[arg-type]
            return r is not None and r.status is ReplicaStatus.DRAINING

        await _until(draining, what="draining visible to the gateway")
        await _until(lambda: agent.status.in_flight == 1, what="in-flight read from redis")
        await asyncio.sleep(0.3)
        assert not task.done()
        await gateway.release(
            lease, Completion(ok=True, prompt_tokens=10, cached_tokens=0, completion_tokens=1)
        )
        assert await asyncio.wait_for(task, 10) == 0
        assert await _replica(gateway, cfg.id) is None  # type: ignore[arg-type]
    finally:
        await sidecar_store.close()
        await gateway.close()


async def test_redis_entry_expires_when_the_sidecar_dies(
    engine: FakeEngine, session: aiohttp.ClientSession, redis_url: str
) -> None:
    from router.store.base import StoreConfig
    from router.store.redis import RedisStore

    cfg = _cfg(engine.url, redis_url=redis_url, gateways=(), replica_ttl_s=0.6, heartbeat_interval_s=0.1)
    sidecar_store = RedisStore.from_url(
        redis_url, gateway_id="sidecar-x", config=StoreConfig(replica_ttl_s=0.6)
    )
    gateway = RedisStore.from_url(redis_url, gateway_id="gw-x", config=StoreConfig(replica_ttl_s=0.6))
    try:
        agent = Agent(cfg, StoreRegistrar(sidecar_store), EngineProbe(session, cfg.engine_url))
        task = asyncio.create_task(agent.run())
        await _until(agent.ready, what="registered")
        await _until(lambda: _replica(gateway, cfg.id), what="visible")  # type: ignore[arg-type]
        task.cancel()  # the sidecar vanishes without deregistering (SIGKILL-like)
        with pytest.raises(asyncio.CancelledError):
            await task

        async def gone() -> bool:
            return await _replica(gateway, cfg.id) is None  # type: ignore[arg-type]

        await _until(gone, timeout_s=5, what="TTL expiry")
    finally:
        await sidecar_store.close()
        await gateway.close()


# ---- the CLI ---------------------------------------------------------------------------------------


def _kvroute(*args: str, timeout: float = 60) -> Any:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "router.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cli_config_error_exits_2_naming_the_flag() -> None:
    res = _kvroute("sidecar", "--engine-url", "http://127.0.0.1:1")
    assert res.returncode == 2 and "need a registry" in res.stderr
    res = _kvroute("sidecar", "--gateway", "http://127.0.0.1:1", "--heartbeat-interval", "-1")
    assert res.returncode == 2 and "--heartbeat-interval" in res.stderr


def test_cli_gives_up_on_an_engine_that_never_comes_up() -> None:
    res = _kvroute(
        "sidecar",
        "--engine-url",
        "http://127.0.0.1:1",
        "--gateway",
        "http://127.0.0.1:1",
        "--listen-host",
        "127.0.0.1",
        "--listen-port",
        "0",
        "--engine-wait-timeout",
        "0.5",
        "--probe-timeout",
        "0.2",
    )
    assert res.returncode == 1, res.stderr
    assert "not healthy after 0.5s" in res.stderr
    assert json.loads(res.stdout.splitlines()[0])["event"] == "listening"
