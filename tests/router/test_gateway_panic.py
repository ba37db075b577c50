"""When every replica looks down the gateway still tries them (panic routing), and the pure view it
hands the policy for that."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from router.events import RequestRouted
from router.gateway.handlers import panic_snapshot
from router.model import ClusterSnapshot, ReplicaState, ReplicaStatus
from router.observability.metrics import GatewayMetrics
from tests.router.conftest import EventLog

A, D, J, R = ReplicaStatus.ACTIVE, ReplicaStatus.DOWN, ReplicaStatus.JOINING, ReplicaStatus.DRAINING


def _snap(*states: tuple[str, ReplicaStatus]) -> ClusterSnapshot:
    return ClusterSnapshot(now=1.0, replicas=tuple(ReplicaState(id=i, url=f"http://{i}", status=s) for i, s in states))


def test_panic_snapshot_shows_down_replicas_active_and_nothing_else_changes() -> None:
    snap = _snap(("a", D), ("b", J), ("c", D), ("d", R))
    panic = panic_snapshot(snap, frozenset({"c"}))
    assert panic is not None
    assert [(r.id, r.status) for r in panic.replicas] == [("a", A), ("b", J), ("c", A), ("d", R)]
    assert panic.now == snap.now and panic.session == snap.session
    # nothing DOWN outside the excluded set: nothing to panic-route to
    assert panic_snapshot(snap, frozenset({"a", "c"})) is None
    assert panic_snapshot(_snap(("a", J)), frozenset()) is None


async def _post(s: aiohttp.ClientSession, url: str, sid: str) -> tuple[int, Any]:
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    hdrs = {"Content-Type": "application/json", "Modal-Session-Id": sid}
    async with s.post(url + "/v1/completions", data=body, headers=hdrs) as r:
        return r.status, await r.json(content_type=None)


async def test_every_replica_down_is_still_tried_not_refused(fake_replicas: Any, gateway_factory: Any) -> None:
    """Health said DOWN (e.g. slow probes of busy engines) but the engines serve: clients get answers,
    the session keeps its home; only when nothing answers at all does the client get an error."""
    reps = await fake_replicas(2)
    log, metrics = EventLog(), GatewayMetrics()
    gw = await gateway_factory(
        [r.url for r in reps], hooks=(log, metrics), health={"health_interval_s": 30.0, "scrape_interval_s": 30.0}
    )
    async with aiohttp.ClientSession() as s:
        status, _ = await _post(s, gw.url, "s-1")
        assert status == 200
        for r in reps:
            await gw.store.set_status(r.id, D)
        for _ in range(4):
            status, doc = await _post(s, gw.url, "s-1")
            assert status == 200, doc
        routed = [e for e in log.events if isinstance(e, RequestRouted)]
        assert [e.panic for e in routed] == [False, True, True, True, True]
        assert metrics.registry.get_sample_value("kvroute_panic_routes_total") == 4
        assert all(r.status is D for r in await gw.store.replicas())  # routing does not readmit
        # nothing listening behind the DOWN replicas: an error the client can read, not a hang
        for r in reps:
            await r.stop()
        status, doc = await _post(s, gw.url, "s-1")
        assert status in (502, 503), doc
        assert doc["error"]["code"] in {"upstream_connect_error", "no_replica"}
    assert all(r.in_flight == 0 for r in await gw.store.replicas())


async def test_panic_keeps_the_sessions_home(fake_replicas: Any, gateway_factory: Any) -> None:
    reps = await fake_replicas(3)
    gw = await gateway_factory(
        [r.url for r in reps], health={"health_interval_s": 30.0, "scrape_interval_s": 30.0}
    )
    async with aiohttp.ClientSession() as s:
        homes = {}
        for sid in ("x", "y", "z", "w"):
            async with s.post(
                gw.url + "/v1/completions",
                data=json.dumps({"model": "m", "prompt": "hi"}).encode(),
                headers={"Content-Type": "application/json", "Modal-Session-Id": sid},
            ) as r:
                assert r.status == 200
                homes[sid] = r.headers["X-Kvroute-Replica"]
        for r in reps:
            await gw.store.set_status(r.id, D)
        for sid, home in homes.items():
            async with s.post(
                gw.url + "/v1/completions",
                data=json.dumps({"model": "m", "prompt": "hi"}).encode(),
                headers={"Content-Type": "application/json", "Modal-Session-Id": sid},
            ) as r:
                assert r.status == 200
                assert r.headers["X-Kvroute-Replica"] == home, sid
