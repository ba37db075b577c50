"""Metrics after real traffic: gateway (real socket) -> emulated SGLang replicas (real sockets).

The gateway runs with the operator surface mounted exactly as ``kvroute serve`` mounts it; /metrics
is scraped over HTTP and parsed with prometheus_client's parser.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from replica.emulator.server import EmulatorConfig, make_emulator_app
from router.gateway.serve import RunningGateway, start_gateway
from router.observability.surface import OperatorSurface, operator_surface_from_config
from tests.router.conftest import fast_config, rerun_start_up_probes, wait_for

TOKEN = "metrics-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class CapturingReplica:
    """The real emulator app plus a middleware that records each inference request's headers."""

    name: str
    url: str = ""
    runner: web.AppRunner | None = None
    headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.url.removeprefix("http://")

    async def start(self, cfg: EmulatorConfig) -> None:
        app = make_emulator_app(dataclasses.replace(cfg, name=self.name))

        @web.middleware
        async def capture(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            if request.method == "POST":
                self.headers.append(dict(request.headers))
            return await handler(request)

        app.middlewares.insert(0, capture)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@dataclass
class Stack:
    replicas: list[CapturingReplica]
    gateway: RunningGateway
    surface: OperatorSurface


@pytest.fixture
async def stack_factory() -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    started: list[Stack] = []

    async def make(n: int = 3, *, tracing_exporter: Any = None, **overrides: Any) -> Stack:
        cfg = EmulatorConfig(time_scale=0.001, default_max_tokens=8)
        reps = [CapturingReplica(f"replica-{i}") for i in range(n)]
        for r in reps:
            await r.start(cfg)
        config = fast_config([r.url for r in reps], admin_token=TOKEN, **overrides)
        surface = operator_surface_from_config(config, tracing_exporter=tracing_exporter)
        surface.sample_interval_s = 0.05
        gw = await start_gateway(config, extra_setup=(surface.setup,))
        st = Stack(reps, gw, surface)
        started.append(st)
        await rerun_start_up_probes(gw, all_join=True)
        await wait_for(lambda: _all_active(gw), timeout_s=10)
        return st

    yield make
    for st in started:
        await st.gateway.close()
        await st.gateway.store.close()
        for r in st.replicas:
            await r.stop()


async def _all_active(gw: RunningGateway) -> bool:
    reps = await gw.store.replicas()
    return bool(reps) and all(r.status.value == "active" and r.engine.updated_at > 0 for r in reps)


def chat_body(turn: int, stream: bool = False, sid: str = "") -> bytes:
    msgs = [{"role": "system", "content": "You are a coding agent. " * 40}]
    for t in range(turn + 1):
        msgs.append({"role": "user", "content": f"{sid} step {t}: edit the file " * 30})
        msgs.append({"role": "assistant", "content": f"done {t}"})
    body: dict[str, Any] = {
        "model": "moonshotai/Kimi-K2.6",
        "messages": msgs[:-1],
        "max_tokens": 8,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def send(
    s: aiohttp.ClientSession, url: str, sid: str | None, turn: int, stream: bool = False
) -> tuple[int, CIMultiDict[str]]:
    hdrs = {"Content-Type": "application/json"}
    if sid is not None:
        hdrs["Modal-Session-Id"] = sid
    async with s.post(
        url + "/v1/chat/completions", data=chat_body(turn, stream, sid or "anon"), headers=hdrs
    ) as r:
        await r.read()
        return r.status, CIMultiDict(r.headers)


def parse(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = [(s.name, dict(s.labels), s.value) for s in fam.samples]
    return out


def total(
    fams: dict[str, list[tuple[str, dict[str, str], float]]], family: str, sample: str, **labels: str
) -> float:
    return sum(
        v
        for n, lab, v in fams.get(family, [])
        if n == sample and all(lab.get(k) == x for k, x in labels.items())
    )


async def test_metrics_after_real_traffic(stack_factory: Callable[..., Awaitable[Stack]]) -> None:
    st = await stack_factory(3)
    gw = st.gateway
    sessions = [f"sess-{i}" for i in range(6)]
    async with aiohttp.ClientSession() as s:
        for turn in range(3):
            results = await asyncio.gather(
                *(send(s, gw.url, sid, turn, stream=(turn == 1)) for sid in sessions)
            )
            assert all(code == 200 for code, _ in results)
        assert (await send(s, gw.url, None, 0))[0] == 200  # no session id: prefix key
        # a client error is counted too, with its status
        async with s.post(
            gw.url + "/v1/chat/completions", data=b"{bad", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
        await asyncio.sleep(0.15)  # at least one fleet sample + engine scrape after the traffic
        async with s.get(gw.url + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
    fams = parse(text)
    n_ok = len(sessions) * 3 + 1
    route = "/v1/chat/completions"
    assert total(fams, "kvroute_requests", "kvroute_requests_total", route=route, status="200") == n_ok
    # early rejections (bad JSON before routing) are counted by the HTTP middleware
    assert (
        total(fams, "kvroute_http_responses", "kvroute_http_responses_total", route=route, status="400") == 1
    )
    assert (
        total(fams, "kvroute_http_responses", "kvroute_http_responses_total", route=route, status="200")
        == n_ok
    )
    # the first turn of each session is a placement; later turns are affinity hits
    assert total(fams, "kvroute_requests", "kvroute_requests_total", reason="placed_new") >= len(sessions)
    assert total(fams, "kvroute_requests", "kvroute_requests_total", reason="affinity") == 2 * len(sessions)
    assert total(
        fams, "kvroute_routing_decisions", "kvroute_routing_decisions_total", key_source="header"
    ) == 3 * len(sessions)
    assert (
        total(fams, "kvroute_routing_decisions", "kvroute_routing_decisions_total", key_source="prefix") == 1
    )
    assert total(fams, "kvroute_ttft_seconds", "kvroute_ttft_seconds_count", route=route) == n_ok
    assert total(fams, "kvroute_e2e_seconds", "kvroute_e2e_seconds_count", route=route) == n_ok
    assert total(fams, "kvroute_gateway_overhead_seconds", "kvroute_gateway_overhead_seconds_count") >= n_ok
    # cached tokens were learned from the engine's usage (later turns hit the prefix cache)
    prompt = total(fams, "kvroute_prompt_tokens", "kvroute_prompt_tokens_total")
    cached = total(fams, "kvroute_cached_tokens", "kvroute_cached_tokens_total")
    assert prompt > 0 and 0 < cached < prompt
    # fleet gauges per replica, in flight back to 0
    ids = {r.id for r in st.replicas}
    inflight = {lab["replica"]: v for n, lab, v in fams["kvroute_replica_in_flight_requests"]}
    assert set(inflight) == ids and all(v == 0 for v in inflight.values())
    assert {lab["replica"] for _, lab, _ in fams["kvroute_replica_kv_utilization_ratio"]} == ids
    sessions_per_replica = {lab["replica"]: v for _, lab, v in fams["kvroute_replica_sessions_active"]}
    assert sum(sessions_per_replica.values()) == len(sessions) + 1  # + the prefix-keyed request
    assert total(fams, "kvroute_sessions_active", "kvroute_sessions_active") == len(sessions) + 1
    # engine gauges re-exported from the emulators' sglang: metrics
    cap = {lab["replica"]: v for _, lab, v in fams["kvroute_engine_max_total_tokens"]}
    assert set(cap) == ids and all(v > 0 for v in cap.values())
    assert {lab["replica"] for _, lab, _ in fams["kvroute_engine_scrape_age_seconds"]} == ids
    status = {(lab["replica"], lab["status"]): v for _, lab, v in fams["kvroute_replica_status"]}
    assert all(status[(rid, "active")] == 1 for rid in ids)
    assert total(fams, "kvroute_replicas_active", "kvroute_replicas_active") == 3
    assert "kvroute_load_dispersion_ratio" in fams
    assert total(fams, "kvroute_desired_replicas", "kvroute_desired_replicas") >= 1
    # low cardinality: no session id in any label value, every family prefixed kvroute_
    for name, samples in fams.items():
        assert name.startswith("kvroute_"), name
        for _, lab, _ in samples:
            assert not any("sess-" in v for v in lab.values()), (name, lab)


async def test_retries_and_ejections_are_counted(stack_factory: Callable[..., Awaitable[Stack]]) -> None:
    st = await stack_factory(2)
    gw = st.gateway
    victim = st.replicas[0]
    await victim.stop()  # connection refused from now on
    async with aiohttp.ClientSession() as s:
        for i in range(6):
            code, hdrs = await send(s, gw.url, f"r-{i}", 0)
            assert code == 200 and hdrs["X-Kvroute-Replica"] == st.replicas[1].id
        await wait_for(lambda: _down(gw, victim.id), timeout_s=10)
        async with s.get(gw.url + "/metrics") as r:
            fams = parse(await r.text())
    assert total(fams, "kvroute_replica_ejections", "kvroute_replica_ejections_total", replica=victim.id) >= 1
    retries = total(fams, "kvroute_upstream_retries", "kvroute_upstream_retries_total")
    decisions = total(fams, "kvroute_routing_decisions", "kvroute_routing_decisions_total")
    assert decisions == 6 + retries  # one decision per attempt
    status = {(lab["replica"], lab["status"]): v for _, lab, v in fams["kvroute_replica_status"]}
    assert status[(victim.id, "down")] == 1


async def _down(gw: RunningGateway, rid: str) -> bool:
    return any(r.id == rid and r.status.value == "down" for r in await gw.store.replicas())


async def test_admin_stats_and_patch_through_the_gateway(
    stack_factory: Callable[..., Awaitable[Stack]],
) -> None:
    """PATCH /admin/config on a live gateway changes the next decisions; /admin/stats matches traffic."""
    st = await stack_factory(3)
    gw = st.gateway
    async with aiohttp.ClientSession() as s:
        homes = set()
        for turn in range(3):
            code, hdrs = await send(s, gw.url, "sticky", turn)
            assert code == 200
            homes.add(hdrs["X-Kvroute-Replica"])
        assert len(homes) == 1  # kv_aware keeps the session home
        async with s.patch(gw.url + "/admin/config", json={"policy": "round_robin"}, headers=AUTH) as r:
            assert r.status == 200 and (await r.json())["policy"] == "round_robin"
        seen = []
        for turn in range(3, 9):
            code, hdrs = await send(s, gw.url, "sticky", turn)
            assert code == 200 and hdrs["X-Kvroute-Reason"] == "round_robin"
            seen.append(hdrs["X-Kvroute-Replica"])
        assert set(seen) == {r.id for r in st.replicas}  # the session is no longer sticky
        async with s.patch(
            gw.url + "/admin/config",
            json={"policy": "kv_aware", "params": {"thicc_threshold": 1}},
            headers=AUTH,
        ) as r:
            assert r.status == 200 and (await r.json())["params"]["thicc_threshold"] == 1
        async with s.patch(
            gw.url + "/admin/config", json={"params": {"thicc_threshold": -3}}, headers=AUTH
        ) as r:
            assert r.status == 400 and "thicc_threshold" in (await r.json())["error"]["message"]
        await asyncio.sleep(0.12)
        async with s.get(gw.url + "/admin/stats", headers=AUTH) as r:
            stats = await r.json()
        async with s.get(gw.url + "/admin/sessions/sticky", headers=AUTH) as r:
            sess = await r.json()
    assert stats["policy"] == "kv_aware" and stats["policy_generation"] == 2
    fleet = stats["fleet"]
    assert fleet["requests_total"] == 9 and fleet["decisions_by_reason"]["total"]["round_robin"] == 6
    assert fleet["chr_total"] is not None and 0 < fleet["chr_total"] < 1
    assert {r["id"] for r in stats["replicas"]} == {r.id for r in st.replicas}
    assert all(r["status"] == "active" and r["in_flight"] == 0 for r in stats["replicas"])
    assert stats["series"], "the fleet sampler runs inside the gateway"
    assert sess["session_id"] == "sticky" and sess["turns"] >= 1 and sess["in_flight_total"] == 0
    assert sess["home"] in {r.id for r in st.replicas}


async def test_redis_round_trips_and_degradation(
    stack_factory: Callable[..., Awaitable[Stack]], redis_killable: Any
) -> None:
    """With the Redis store: round trips are exported; killing Redis shows up as degradation."""
    st = await stack_factory(2, redis_url=redis_killable.url)
    gw = st.gateway
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            assert (await send(s, gw.url, f"redis-{i}", 0))[0] == 200
        async with s.get(gw.url + "/metrics") as r:
            before = parse(await r.text())
        assert (
            total(before, "kvroute_store_round_trips", "kvroute_store_round_trips_total") >= 8
        )  # acquire+release
        assert total(before, "kvroute_store_degraded", "kvroute_store_degraded") == 0
        assert total(before, "kvroute_store_degradations", "kvroute_store_degradations_total") == 0
        # the gateway's own discovery: at least the first round's check and scrape of both replicas
        probes = ("kvroute_discovery_probes", "kvroute_discovery_probes_total")
        assert total(before, *probes, probe="health", outcome="ok") >= 2
        assert total(before, *probes, probe="scrape", outcome="ok") >= 2
        assert total(before, *probes, probe="health", outcome="failed") == 0
        redis_killable.kill()
        for i in range(3):  # no request fails because Redis did
            assert (await send(s, gw.url, f"redis-{i}", 1))[0] == 200
        async with s.get(gw.url + "/metrics") as r:
            after = parse(await r.text())
        async with s.get(gw.url + "/admin/stats", headers=AUTH) as r:
            stats = await r.json()
    assert total(after, "kvroute_store_degraded", "kvroute_store_degraded") == 1
    assert total(after, "kvroute_store_degradations", "kvroute_store_degradations_total") >= 1
    assert (
        stats["degradation"]["store_degraded"] is True and stats["degradation"]["store_degraded_total"] >= 1
    )
