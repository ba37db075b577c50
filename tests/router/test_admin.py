"""Admin REST API on a real socket (aiohttp test server on 127.0.0.1:0) over a MemoryStore.

Every endpoint, auth failures (401 without / with a wrong token, cookie only for reads), validation
errors as OpenAI-style JSON, and a PATCH that changes the next routing decision.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from router.clock import VirtualClock
from router.gateway.admin import ADMIN_COOKIE, AdminSettings, PolicyHolder, replica_view, residency_view
from router.model import (
    BindSession,
    ClusterSnapshot,
    Completion,
    EngineLoad,
    HealthStamp,
    KeySource,
    Reason,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
)
from router.observability.surface import make_operator_surface
from router.policy.params import PolicyParams
from router.store.memory import MemoryStore

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ClientFactory = Callable[[web.Application], Awaitable[TestClient]]


def _store(clock: VirtualClock) -> MemoryStore:
    store = MemoryStore(clock)
    for i in range(3):
        store.core.upsert_replica(
            ReplicaSpec(
                id=f"127.0.0.1:{31001 + i}", url=f"http://127.0.0.1:{31001 + i}", capacity_tokens=100_000
            ),
            ReplicaStatus.ACTIVE,
        )
    return store


def _app(store: MemoryStore, clock: VirtualClock, settings: AdminSettings) -> tuple[web.Application, Any]:
    surface = make_operator_surface(
        store=store, clock=clock, holder=PolicyHolder("kv_aware", PolicyParams()), admin=settings
    )
    app = web.Application()
    surface.setup(app)
    return app, surface


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(100.0)


@pytest.fixture
async def admin(aiohttp_client: ClientFactory, clock: VirtualClock) -> tuple[TestClient, MemoryStore, Any]:
    store = _store(clock)
    app, surface = _app(store, clock, AdminSettings(token=TOKEN))
    return await aiohttp_client(app), store, surface


def _assert_error(body: dict[str, Any], code: str | None = None) -> dict[str, Any]:
    err = body["error"]
    assert set(err) >= {"message", "type", "code"}
    if code is not None:
        assert err["code"] == code, err
    return err


ENDPOINTS = [
    ("GET", "/admin/stats"),
    ("GET", "/admin/replicas"),
    ("POST", "/admin/replicas"),
    ("POST", "/admin/replicas/x/drain"),
    ("DELETE", "/admin/replicas/x"),
    ("GET", "/admin/sessions/s"),
    ("GET", "/admin/config"),
    ("PATCH", "/admin/config"),
    ("GET", "/admin/openapi.json"),
    ("GET", "/admin/ui"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
async def test_every_endpoint_requires_the_token(
    admin: tuple[TestClient, MemoryStore, Any], method: str, path: str, headers: dict[str, str]
) -> None:
    client, _, _ = admin
    resp = await client.request(method, path, headers=headers, json={})
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    _assert_error(await resp.json(), "unauthorized")


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
async def test_no_token_configured_disables_admin(
    aiohttp_client: ClientFactory, clock: VirtualClock, method: str, path: str
) -> None:
    app, _ = _app(_store(clock), clock, AdminSettings(token=None))
    client = await aiohttp_client(app)
    resp = await client.request(method, path, headers=AUTH, json={})
    assert resp.status == 404
    _assert_error(await resp.json(), "not_found")


async def test_insecure_mode_serves_without_token(aiohttp_client: ClientFactory, clock: VirtualClock) -> None:
    app, _ = _app(_store(clock), clock, AdminSettings(token=None, insecure=True))
    client = await aiohttp_client(app)
    resp = await client.get("/admin/config")
    assert resp.status == 200 and (await resp.json())["policy"] == "kv_aware"


async def test_stats_reports_store_and_events(
    admin: tuple[TestClient, MemoryStore, Any], clock: VirtualClock
) -> None:
    client, store, surface = admin
    core = store.core
    core.report_engine_load(
        "127.0.0.1:31001",
        EngineLoad(running=2, queued=1, kv_util=0.5, cache_hit_rate=0.9, updated_at=99.0, reported_by="gw-b~1"),
    )
    core.report_health({"127.0.0.1:31001": HealthStamp(99.5, "sidecar:127.0.0.1:31001", 10.0)})
    # two requests in flight on replica 1, one on replica 2; one session bound to replica 1
    req = RouteRequest(session_key="sess-a")
    core.acquire(
        RouteDecision(
            "127.0.0.1:31001",
            Reason.PLACED_NEW,
            (BindSession("sess-a", "127.0.0.1:31001", None, Reason.PLACED_NEW),),
        ),
        req,
    )
    core.acquire(RouteDecision("127.0.0.1:31001", Reason.AFFINITY), RouteRequest(session_key=None))
    core.acquire(RouteDecision("127.0.0.1:31002", Reason.PLACED_NEW), RouteRequest(session_key=None))
    surface.stats.record_decision(clock.now(), "placed_new")
    surface.stats.record_finished(clock.now(), status="200", prompt_tokens=1000, cached_tokens=750)
    surface.stats.record_break(clock.now(), "evicted", "127.0.0.1:31002")
    await surface.sampler.sample_once()

    resp = await client.get("/admin/stats", headers=AUTH)
    assert resp.status == 200
    body = await resp.json()
    reps = {r["id"]: r for r in body["replicas"]}
    r1 = reps["127.0.0.1:31001"]
    assert r1["status"] == "active" and r1["in_flight"] == 2
    assert (
        r1["running"] == 2
        and r1["queued"] == 1
        and r1["kv_util"] == 0.5
        and r1["engine_cache_hit_rate"] == 0.9
    )
    assert r1["sessions_bound"] == 1 and r1["sessions_active"] == 1
    assert r1["engine_age_s"] == pytest.approx(1.0)
    # who probes it: another gateway scraped it, its sidecar checked it (discovery rules 6-8)
    assert (r1["engine_reported_by"], r1["health_checked_by"]) == ("gw-b~1", "sidecar:127.0.0.1:31001")
    assert r1["health_check_age_s"] == pytest.approx(0.5)
    r2 = reps["127.0.0.1:31002"]
    assert (r2["engine_reported_by"], r2["health_checked_by"], r2["health_check_age_s"]) == (None, None, None)
    assert reps["127.0.0.1:31002"]["affinity_breaks"] == 1
    fleet = body["fleet"]
    assert fleet["in_flight"] == 3 and fleet["replicas_active"] == 3
    # loads [2, 1, 0]: mean 1, var 2/3
    assert fleet["dispersion_now"] == pytest.approx(2 / 3, abs=1e-6)
    assert fleet["load_histogram"] == {"0": 1, "1": 1, "2": 1}
    assert fleet["chr_window"] == 0.75 and fleet["chr_total"] == 0.75
    assert fleet["decisions_by_reason"]["total"] == {"placed_new": 1}
    assert fleet["affinity_breaks_by_reason"]["window"] == {"evicted": 1}
    assert body["degradation"] == {
        "store_degraded": False,
        "store_degraded_total": 0,
        "replicas_down": 0,
        "replicas_draining": 0,
        "no_active_replicas": False,
        "panic": False,
    }
    assert body["series"][-1]["in_flight"] == [2, 1, 0]


async def test_replicas_register_update_drain_delete(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, store, _ = admin
    resp = await client.post(
        "/admin/replicas",
        headers=AUTH,
        json={
            "url": "http://127.0.0.1:32000/",
            "model": "kimi",
            "capacity_tokens": 850000,
            "tp_size": 4,
        },
    )
    assert resp.status == 201, await resp.text()
    rep = await resp.json()
    assert rep["id"] == "127.0.0.1:32000" and rep["url"] == "http://127.0.0.1:32000"
    assert rep["status"] == "joining" and rep["capacity_tokens"] == 850000 and rep["model"] == "kimi"
    # upsert again: 200, status given explicitly (sidecar heartbeat)
    resp = await client.post(
        "/admin/replicas",
        headers=AUTH,
        json={"id": "127.0.0.1:32000", "url": "http://127.0.0.1:32000", "status": "active"},
    )
    assert resp.status == 200 and (await resp.json())["status"] == "active"
    ids = [r["id"] for r in (await (await client.get("/admin/replicas", headers=AUTH)).json())["replicas"]]
    assert "127.0.0.1:32000" in ids and len(ids) == 4

    resp = await client.post("/admin/replicas/127.0.0.1:32000/drain", headers=AUTH)
    assert resp.status == 200 and (await resp.json())["status"] == "draining"
    assert {r.id: r.status for r in await store.replicas()}["127.0.0.1:32000"] is ReplicaStatus.DRAINING

    resp = await client.delete("/admin/replicas/127.0.0.1:32000", headers=AUTH)
    assert resp.status == 200 and await resp.json() == {"id": "127.0.0.1:32000", "removed": True}
    assert "127.0.0.1:32000" not in {r.id for r in await store.replicas()}
    for method, path in [
        ("POST", "/admin/replicas/127.0.0.1:32000/drain"),
        ("DELETE", "/admin/replicas/127.0.0.1:32000"),
    ]:
        resp = await client.request(method, path, headers=AUTH)
        assert resp.status == 404
        _assert_error(await resp.json(), "not_found")


async def test_a_data_parallel_rank_registers_as_a_replica_of_its_own(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, store, _ = admin
    for rank in (0, 1):
        resp = await client.post("/admin/replicas", headers=AUTH, json={"url": "http://127.0.0.1:32000", "dp_rank": rank})
        assert resp.status == 201, await resp.text()
        rep = await resp.json()
        assert (rep["id"], rep["url"], rep["dp_rank"]) == (f"127.0.0.1:32000-dp{rank}", "http://127.0.0.1:32000", rank)
    named = await client.post("/admin/replicas", headers=AUTH, json={"url": "http://127.0.0.1:32001", "id": "e1", "dp_rank": 3})
    assert named.status == 201 and (await named.json())["dp_rank"] == 3
    ranks = {r.id: r.dp_rank for r in await store.replicas()}
    assert {k: v for k, v in ranks.items() if v is not None} == {"127.0.0.1:32000-dp0": 0, "127.0.0.1:32000-dp1": 1, "e1": 3}
    whole = await client.post("/admin/replicas", headers=AUTH, json={"url": "http://127.0.0.1:32002", "dp_rank": None})
    assert whole.status == 201 and (await whole.json())["dp_rank"] is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"url": "http://127.0.0.1:1", "dp_rank": -1}, "dp_rank"),
        ({"url": "http://127.0.0.1:1", "dp_rank": 1024}, "dp_rank"),
        ({"url": "http://127.0.0.1:1", "dp_rank": "0"}, "dp_rank"),
        ({"url": "http://127.0.0.1:1", "dp_rank": True}, "dp_rank"),
        ({"url": "ftp://127.0.0.1:1"}, "url: scheme"),
        ({"url": "http://8.8.8.8:80"}, "allowed networks"),
        ({"url": "http://[2001:4860::8888]:80"}, "allowed networks"),
        ({"url": "http://user:pw@127.0.0.1:1"}, "credentials"),
        ({"url": "http://127.0.0.1:1/v1?x=1"}, "base URL"),
        ({"url": "http://127.0.0.1:99999"}, "url"),
        ({"url": "http://bad_host!:1"}, "host"),
        ({"url": 5}, "url"),
        ({}, "url: required"),
        ({"url": "http://127.0.0.1:1", "color": "red"}, "color: unknown field"),
        ({"url": "http://127.0.0.1:1", "capacity_tokens": -1}, "capacity_tokens"),
        ({"url": "http://127.0.0.1:1", "capacity_tokens": True}, "capacity_tokens"),
        ({"url": "http://127.0.0.1:1", "status": "sleepy"}, "status"),
        ({"url": "http://127.0.0.1:1", "id": "a/b"}, "id"),
        ({"url": "http://127.0.0.1:1", "model": 7}, "model"),
        ({"url": "http://127.0.0.1:1", "model": None}, "model"),
        ({"url": "http://127.0.0.1:1", "id": None}, "id"),
        ({"url": "http://127.0.0.1:1", "status": None}, "status"),
        ({"url": "http://127.0.0.1:1", "tp_size": None}, "tp_size"),
    ],
)
async def test_replica_validation_errors(
    admin: tuple[TestClient, MemoryStore, Any], body: dict[str, Any], needle: str
) -> None:
    client, store, _ = admin
    resp = await client.post("/admin/replicas", headers=AUTH, json=body)
    assert resp.status == 400
    err = _assert_error(await resp.json())
    assert needle in err["message"]
    assert len(await store.replicas()) == 3


@pytest.mark.parametrize("raw", [b"{not json", b"[1,2]", b"\xff\xfe", b"x" * 70_000])
async def test_bad_bodies(admin: tuple[TestClient, MemoryStore, Any], raw: bytes) -> None:
    client, _, _ = admin
    for method, path in [("POST", "/admin/replicas"), ("PATCH", "/admin/config")]:
        resp = await client.request(
            method, path, headers={**AUTH, "Content-Type": "application/json"}, data=raw
        )
        assert resp.status == 400
        _assert_error(await resp.json(), "bad_request")


async def test_unknown_route_and_method(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, _, _ = admin
    resp = await client.get("/admin/nope", headers=AUTH)
    assert resp.status == 404
    _assert_error(await resp.json(), "not_found")
    resp = await client.put("/admin/config", headers=AUTH, json={})
    assert resp.status == 405
    assert set(resp.headers["Allow"].split(", ")) == {"GET", "HEAD", "PATCH"}
    _assert_error(await resp.json(), "method_not_allowed")


async def test_session_view(admin: tuple[TestClient, MemoryStore, Any], clock: VirtualClock) -> None:
    client, store, _ = admin
    core = store.core
    rid = "127.0.0.1:31002"
    lease = core.acquire(
        RouteDecision(rid, Reason.PLACED_NEW, (BindSession("s-1", rid, None, Reason.PLACED_NEW),)),
        RouteRequest(session_key="s-1"),
    )
    clock.advance(2.0)
    core.release(lease, Completion(ok=True, prompt_tokens=20_000, cached_tokens=0, completion_tokens=100))
    core.acquire(RouteDecision(rid, Reason.AFFINITY), RouteRequest(session_key="s-1"))
    clock.advance(3.0)
    resp = await client.get("/admin/sessions/s-1", headers=AUTH)
    assert resp.status == 200
    body = await resp.json()
    assert body["home"] == rid and body["home_status"] == "active" and body["overflow"] == []
    assert body["in_flight"] == {rid: 1} and body["in_flight_total"] == 1
    assert body["context_tokens"] == 20_100 and body["turns"] == 1
    assert body["last_seen_s_ago"] == pytest.approx(3.0)
    assert body["residency"]["estimate"] == "resident"
    assert body["residency"]["tokens_written_since"] == 0 and body["residency"]["capacity_tokens"] == 100_000
    resp = await client.get("/admin/sessions/nobody", headers=AUTH)
    assert resp.status == 404
    _assert_error(await resp.json(), "not_found")
    resp = await client.get("/admin/sessions/" + "x" * 300, headers=AUTH)
    assert resp.status == 400


def test_residency_estimate() -> None:
    home = ReplicaState(id="r", url="u", capacity_tokens=1000, host_capacity_tokens=1000, tokens_written=5000)
    fresh = SessionState(session_id="s", home="r", residency_mark=4500, context_tokens=500)
    gone = SessionState(session_id="s", home="r", residency_mark=2000, context_tokens=500)
    never = SessionState(session_id="s", home="r", residency_mark=0)
    p = PolicyParams()
    assert residency_view(fresh, home, p)["estimate"] == "resident"
    assert residency_view(fresh, home, p)["pressure"] == 0.25  # 500 written of a 2,000-token cache
    assert residency_view(gone, home, p)["estimate"] == "likely_evicted"
    assert residency_view(never, home, p)["estimate"] == "unknown"
    assert residency_view(fresh, None, p)["estimate"] == "unknown"
    # the engine's answers showed this home's sessions gone after 400 tokens: the view follows
    learned = dataclasses.replace(home, residency_horizon_tokens=400)
    assert residency_view(fresh, learned, p)["estimate"] == "likely_evicted"


def test_replica_view_shows_the_learned_residency_horizon() -> None:
    # what rule 6 feedback learned (0 until a session's cache was seen gone): an operator reads it
    # beside tokens_written to see how soon the policy presumes caches gone there
    home = ReplicaState(id="r", url="u", capacity_tokens=1000, tokens_written=5000)
    assert replica_view(home, 0.0)["residency_horizon_tokens"] == 0
    learned = dataclasses.replace(home, residency_horizon_tokens=400)
    view = replica_view(learned, 0.0)
    assert (view["residency_horizon_tokens"], view["tokens_written"]) == (400, 5000)


async def test_kv_events_without_a_residency_service_reads_off(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, _, _ = admin
    r = await client.get("/admin/kv-events", headers=AUTH)
    assert r.status == 200 and await r.json() == {"mode": "off"}
    assert (await client.get("/admin/kv-events")).status == 401


async def test_config_get_patch_and_validation(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, _, surface = admin
    body = await (await client.get("/admin/config", headers=AUTH)).json()
    assert (
        body["policy"] == "kv_aware"
        and body["params"] == PolicyParams().to_dict()
        and body["generation"] == 0
    )
    resp = await client.patch(
        "/admin/config", headers=AUTH, json={"params": {"thicc_threshold": 5, "w_sessions": 0.5}}
    )
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert (
        body["params"]["thicc_threshold"] == 5
        and body["params"]["w_sessions"] == 0.5
        and body["generation"] == 1
    )
    assert surface.holder.params.thicc_threshold == 5
    for bad, needle in [
        ({"params": {"no_such_knob": 1}}, "no_such_knob"),
        ({"params": {"thicc_threshold": "many"}}, "thicc_threshold"),
        ({"params": {"thicc_threshold": 0}}, "thicc_threshold"),
        ({"params": {"panic_threshold": 7.0}}, "panic_threshold"),
        ({"params": {"w_sessions": -1}}, "w_sessions"),
        ({"params": [1]}, "params"),
        ({"policy": "magic"}, "policy"),
        ({"policy": 3}, "policy"),
        ({"policy": None}, "policy"),
        ({"params": None}, "params"),
        ({"knobs": {}}, "knobs"),
    ]:
        resp = await client.patch("/admin/config", headers=AUTH, json=bad)
        assert resp.status == 400, bad
        assert needle in _assert_error(await resp.json(), "bad_request")["message"]
    # nothing half-applied
    body = await (await client.get("/admin/config", headers=AUTH)).json()
    assert body["params"]["thicc_threshold"] == 5 and body["generation"] == 1 and body["policy"] == "kv_aware"
    resp = await client.patch("/admin/config", headers=AUTH, json={"policy": "round_robin"})
    assert (await resp.json())["policy"] == "round_robin" and surface.holder.current.name == "round_robin"


async def test_patched_config_changes_the_decision(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    """A thicc session: 2 requests in flight at home. Default threshold 3 keeps it home; PATCH to 2 splits."""
    client, _, surface = admin
    reps = tuple(
        ReplicaState(
            id=f"r{i}",
            url=f"http://127.0.0.1:{9000 + i}",
            status=ReplicaStatus.ACTIVE,
            capacity_tokens=850_000,
            in_flight=2 if i == 0 else 0,
        )
        for i in range(3)
    )
    sess = SessionState(
        session_id="thicc",
        home="r0",
        in_flight=(("r0", 2),),
        context_tokens=10_000,
        last_seen=99.0,
        residency_mark=1,
        turns=3,
    )
    snap = ClusterSnapshot(now=100.0, replicas=reps, session=sess, sessions_active=1)
    req = RouteRequest(session_key="thicc", key_source=KeySource.HEADER)
    before = surface.holder.route(req, snap, random.Random(1))
    assert before.replica_id == "r0" and before.reason is Reason.AFFINITY
    resp = await client.patch("/admin/config", headers=AUTH, json={"params": {"thicc_threshold": 2}})
    assert resp.status == 200
    after = surface.holder.route(req, snap, random.Random(1))
    assert after.reason is Reason.THICC_SPLIT and after.replica_id != "r0"


async def test_openapi_and_dashboard_and_cookie(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, _, _ = admin
    spec = await (await client.get("/admin/openapi.json", headers=AUTH)).json()
    assert spec["openapi"].startswith("3.") and "/admin/stats" in spec["paths"]
    resp = await client.get("/admin/ui", headers=AUTH)
    assert resp.status == 200 and resp.content_type == "text/html"
    assert "/admin/stats" in await resp.text()
    # token exchange: wrong token 401, right token -> 303 + HttpOnly cookie
    resp = await client.get("/admin/ui?token=nope", allow_redirects=False)
    assert resp.status == 401
    resp = await client.get(f"/admin/ui?token={TOKEN}", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/admin/ui"
    cookie = resp.cookies[ADMIN_COOKIE]
    assert cookie["httponly"] and cookie["samesite"] == "Strict"
    assert cookie.value != TOKEN  # derived from the token, not the token
    assert (await client.get("/admin/stats", cookies={ADMIN_COOKIE: TOKEN})).status == 401
    # the cookie authorises reads only
    jar = {ADMIN_COOKIE: cookie.value}
    assert (await client.get("/admin/stats", cookies=jar)).status == 200
    resp = await client.patch("/admin/config", cookies=jar, json={"params": {"thicc_threshold": 9}})
    assert resp.status == 401
    resp = await client.get("/admin/stats", cookies={ADMIN_COOKIE: "forged"})
    assert resp.status == 401


async def test_metrics_endpoint_is_outside_admin(admin: tuple[TestClient, MemoryStore, Any]) -> None:
    client, _, _ = admin
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    assert 'kvroute_replica_in_flight_requests{replica="127.0.0.1:31001"} 0.0' in await resp.text()


async def test_a_shared_config_this_gateway_cannot_install_is_skipped_not_fatal() -> None:
    """The follower of the store's shared config survives any document another writer left there (not
    JSON, the wrong shape, an unknown policy, a bad value, nesting past the parser's depth): it logs
    it, keeps routing with what it has, and installs the next good one."""
    import asyncio

    from router.gateway.admin import follow_shared_config

    store = MemoryStore(VirtualClock())
    holder = PolicyHolder("kv_aware", PolicyParams())
    task = asyncio.create_task(follow_shared_config(store, holder, 0.001))
    try:
        for doc in ("not json", "[]", '{"policy": "kv_aware"}', '{"policy": "nope", "params": {}}',
                    '{"policy": "kv_aware", "params": {"thicc_threshold": -1}}', '{"policy": "kv_aware", "params": []}',
                    "[" * 100_000 + "]" * 100_000):  # fmt: skip
            gen = await store.share_config(doc)
            async with asyncio.timeout(5):
                while holder.shared_generation != gen:
                    await asyncio.sleep(0.001)
            assert (holder.name, holder.params, holder.generation) == ("kv_aware", PolicyParams(), 0), doc[:40]
        gen = await store.share_config('{"policy": "hash", "params": {"thicc_threshold": 5}}')
        async with asyncio.timeout(5):
            while holder.shared_generation != gen:
                await asyncio.sleep(0.001)
        assert (holder.name, holder.params.thicc_threshold, holder.generation) == ("hash", 5, 1)
        assert not task.done()
    finally:
        task.cancel()
