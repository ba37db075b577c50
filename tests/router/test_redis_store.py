"""What only the Redis store has: key scheme and hash slot, registry TTLs, gateway leases, AUTH and TLS
URLs, round trips per request (from Redis's own command stats), degraded mode and resync."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from loadtests.procs import free_port
from loadtests.redis_server import RedisServer, RedisUnavailable
from router.clock import VirtualClock
from router.errors import ReplicaNotFoundError, StaleSessionError, StoreError
from router.model import (
    BindSession,
    Completion,
    EngineLoad,
    PinKind,
    Reason,
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    fleet_totals,
)
from router.store.base import StateStore, StoreConfig
from router.store.factory import make_store
from router.store.keys import KeySpace, session_field
from router.store.memory import MemoryStore
from router.store.redis import RedisStore, make_redis_store
from tests.ci import missing

A = ReplicaStatus.ACTIVE


def bind(sid: str, rid: str, only_if: str | None = None) -> RouteDecision:
    return RouteDecision(rid, Reason.PLACED_NEW, (BindSession(sid, rid, only_if, Reason.PLACED_NEW),))


def spec(rid: str, source: str = "static") -> ReplicaSpec:
    return ReplicaSpec(id=rid, url=f"http://{rid}", source=source)


@pytest.fixture
async def clock() -> VirtualClock:
    return VirtualClock(5000.0)


@pytest.fixture
async def stores(redis_url: str, clock: VirtualClock) -> AsyncIterator[list[RedisStore]]:
    made: list[RedisStore] = []
    yield made
    for s in made:
        await s.close()


def new_store(
    made: list[RedisStore], url: str, clock: VirtualClock, gid: str = "g1", **kw: object
) -> RedisStore:
    cfg = kw.pop("config", None) or StoreConfig()
    s = RedisStore.from_url(url, gid, cfg, clock, epoch_offset_s=0.0, **kw)  # type: ignore[arg-type]
    made.append(s)
    return s


# ---- keys ----------------------------------------------------------------------------------------


def test_key_scheme_is_pure_and_tagged() -> None:
    k = KeySpace("fleet-a")
    assert k.base == "{fleet-a}:"
    assert k.session("abc") == "{fleet-a}:s:abc"
    assert k.replica("10.0.0.1:8000") == "{fleet-a}:r:10.0.0.1:8000"
    assert k.gateway_inflight("gw1") == "{fleet-a}:gw:gw1:if"
    assert session_field("gw1", "r:1") == "f:gw1|r:1"
    names = [k.seq, k.replicas, k.gateways, k.active("r"), k.active_ctx("r"), k.placements("r"),
             k.home_index("r"), k.session("s{x}"), k.gateway_inflight("g")]  # fmt: skip
    assert len({key_slot(n.encode()) for n in names}) == 1
    for bad in ("", "a{b", "a}b"):
        with pytest.raises(ValueError):
            KeySpace(bad)


async def test_every_key_written_lives_in_one_slot(redis_url: str, stores: list[RedisStore], clock) -> None:  # type: ignore[no-untyped-def]
    s = new_store(stores, redis_url, clock, config=StoreConfig(key_prefix="t1"))
    for i in range(3):
        await s.upsert_replica(spec(f"r{i}"), A)
    for i in range(20):
        lease = await s.acquire(bind(f"sess-{{{i}}}", f"r{i % 3}"), RouteRequest(f"sess-{{{i}}}"))
        await s.release(lease, Completion(ok=True, prompt_tokens=100, completion_tokens=1))
    await s.report_engine_load("r0", EngineLoad(running=1, updated_at=clock.now()))
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter("*"))
    r.close()
    assert len(keys) >= 35  # 20 sessions + per-replica keys + fleet keys
    assert all(k.startswith(b"{t1}:") for k in keys)
    assert {key_slot(k) for k in keys} == {key_slot(b"{t1}:seq")}


async def test_a_figure_a_newer_version_writes_is_left_out_not_an_error(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    """Gateways and sidecars of two versions share one Redis during a rolling upgrade: an engine load
    with a field this version does not know reads as the figures it knows."""

    @dataclasses.dataclass(frozen=True, slots=True)
    class NewerLoad(EngineLoad):
        figure_of_a_later_version: int = 7

    writer, reader = new_store(stores, redis_url, clock, "g1"), new_store(stores, redis_url, clock, "g2")
    await writer.upsert_replica(spec("r0"), A)
    await writer.report_engine_load("r0", NewerLoad(running=3, dp_ranks=2, updated_at=clock.now()))
    (r0,) = await reader.replicas()
    assert type(r0.engine) is EngineLoad and (r0.engine.running, r0.engine.dp_ranks) == (3, 2)


async def test_a_replica_that_is_one_data_parallel_rank_reads_back_as_that_rank(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    """A rank registered by one gateway is that rank to every other (the spec's ``dp_rank``); a spec
    field a newer version writes is left out, as an engine figure is."""
    writer, reader = new_store(stores, redis_url, clock, "g1"), new_store(stores, redis_url, clock, "g2")
    await writer.upsert_replica(dataclasses.replace(spec("e-dp1"), dp_rank=1), A)
    await writer.upsert_replica(spec("whole"), A)
    assert {r.id: r.dp_rank for r in await reader.replicas()} == {"e-dp1": 1, "whole": None}

    @dataclasses.dataclass(frozen=True, slots=True)
    class NewerSpec(ReplicaSpec):
        field_of_a_later_version: int = 7

    await writer.upsert_replica(NewerSpec(id="newer", url="http://newer", dp_rank=2), A)
    assert {r.id: (r.url, r.dp_rank) for r in await reader.replicas()}["newer"] == ("http://newer", 2)


# ---- registry TTL --------------------------------------------------------------------------------


async def test_sidecar_registry_entries_expire_static_ones_do_not(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    s = new_store(stores, redis_url, clock, config=StoreConfig(replica_ttl_s=5))
    await s.upsert_replica(spec("static"), A)
    await s.upsert_replica(spec("side", source="registry"), A)
    clock.advance(4)
    await s.report_engine_load("side", EngineLoad(running=2, updated_at=clock.now()))  # heartbeat: refresh
    clock.advance(4)
    assert [r.id for r in await s.replicas()] == ["side", "static"]
    clock.advance(1.5)
    assert [r.id for r in await s.replicas()] == ["static"]
    with pytest.raises(ReplicaNotFoundError):
        await s.set_status("side", A)
    await s.upsert_replica(spec("side", source="registry"))  # re-registers afresh (JOINING)
    side = next(r for r in await s.replicas() if r.id == "side")
    assert side.status is ReplicaStatus.JOINING and side.engine == EngineLoad()


# ---- leases --------------------------------------------------------------------------------------


async def test_lost_lease_is_restored_exactly(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    cfg = StoreConfig(lease_ttl_s=0.6)
    g1 = new_store(stores, redis_url, clock, "g1", config=cfg)
    g2 = new_store(stores, redis_url, clock, "g2", config=cfg)
    await g1.upsert_replica(spec("r0"), A)
    await g1.start()
    leases = [await g1.acquire(bind("s", "r0"), RouteRequest("s")) for _ in range(3)]
    assert (await g2.snapshot("s")).replicas[0].in_flight == 3
    # g1's lease is wiped (as if it had stalled past its TTL and another gateway collected it)
    r = aioredis.Redis.from_url(redis_url)
    await r.zrem("{kvroute}:gw", g1.lease_holder)
    await r.delete(f"{{kvroute}}:gw:{g1.lease_holder}:if")
    snap = await g2.snapshot("s")
    assert snap.replicas[0].in_flight == 0 and snap.session is not None and snap.session.in_flight == ()
    deadline = time.monotonic() + 3
    while (await g2.snapshot("s")).replicas[0].in_flight != 3:  # g1's heartbeat notices and restores
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    snap = await g2.snapshot("s")
    assert snap.session is not None and snap.session.in_flight == (("r0", 3),)
    for lease in leases:
        await g1.release(lease, Completion(ok=False))
    assert (await g2.snapshot("s")).replicas[0].in_flight == 0
    assert g1.degraded_total == 0
    await r.aclose()


async def test_graceful_close_drops_load_at_once(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    g1 = new_store(stores, redis_url, clock, "g1")
    g2 = new_store(stores, redis_url, clock, "g2")
    await g1.upsert_replica(spec("r0"), A)
    await g1.acquire(bind("s", "r0"), RouteRequest("s"))
    assert (await g2.replicas())[0].in_flight == 1
    await g1.close()
    assert (await g2.replicas())[0].in_flight == 0


# ---- URLs: AUTH, TLS, factory --------------------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["auth", "auth+tls"])
async def test_auth_and_tls_urls(tls: bool, clock: VirtualClock) -> None:
    try:
        server = RedisServer(password="s3cret-pw", tls=tls).start()
    except RedisUnavailable as exc:
        missing(f"cannot start redis-server with AUTH/TLS: {exc}")
    try:
        made: list[RedisStore] = []
        ok = new_store(made, server.url, clock, op_timeout_s=3.0)  # TLS handshakes on a busy box
        await ok.upsert_replica(spec("r0"), A)
        lease = await ok.acquire(bind("s", "r0"), RouteRequest("s"))
        assert lease.replica_id == "r0"
        assert ok.degraded_total == 0
        bad_url = server.url.replace("s3cret-pw", "wrong")
        bad = new_store(made, bad_url, clock, "g2", op_timeout_s=3.0)
        snap = await bad.snapshot(None)  # refused by Redis: served locally, never raised
        assert snap.replicas == () and bad.degraded and bad.last_error is not None
        assert "auth" in bad.last_error.lower() or "pass" in bad.last_error.lower()
        for s in made:
            await s.close()
    finally:
        server.cleanup()


@pytest.mark.parametrize("query", ["", "?db=0", "?db=0&cluster=false"])
async def test_unix_socket_url(query: str, clock: VirtualClock, tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    server = RedisServer(extra_args=("--unixsocket", str(sock), "--unixsocketperm", "700")).start()
    try:
        made: list[RedisStore] = []
        s = new_store(made, f"unix://{sock}{query}", clock, op_timeout_s=3.0)
        await s.upsert_replica(spec("r0"), A)
        assert (await s.acquire(bind("s", "r0"), RouteRequest("s"))).replica_id == "r0"
        assert s.degraded_total == 0 and not s.degraded
        for st in made:
            await st.close()
    finally:
        server.cleanup()


async def test_factory_chooses_by_config(redis_url: str) -> None:
    class Cfg:
        def __init__(self, url: str | None) -> None:
            self.redis_url = url
            self.gateway_id = "host|1"

    clock = VirtualClock()
    assert isinstance(make_store(Cfg(None), clock), MemoryStore)
    store = make_store(Cfg(redis_url), clock)
    assert isinstance(store, RedisStore) and store.gateway_id == "host_1"
    await store.close()
    with pytest.raises(StoreError):
        make_redis_store(Cfg(None), clock)


# ---- round trips ---------------------------------------------------------------------------------


def _top_level_calls(r: redis.Redis) -> dict[str, int]:
    """Calls of the commands a client can send to run scripts (commands *inside* scripts are counted
    by commandstats too, under their own names)."""
    stats = r.info("commandstats")
    return {k: int(v["calls"]) for k, v in stats.items() if k.split("|")[0] in
            ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro", "cmdstat_script")}  # fmt: skip


async def test_three_round_trips_per_request(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    s = new_store(stores, redis_url, clock, config=StoreConfig(lease_ttl_s=3600))
    for i in range(4):
        await s.upsert_replica(spec(f"r{i}"), A)
    await s.start()
    lease = await s.acquire(bind("warm", "r0"), RouteRequest("warm"))  # scripts loaded, lease fresh
    await s.release(lease, Completion(ok=False))
    r = redis.Redis.from_url(redis_url)
    r.config_resetstat()
    n = 50
    for i in range(n):
        sid = f"s{i % 10}"
        snap = await s.snapshot(sid)
        d = (
            bind(sid, f"r{i % 4}", None)
            if snap.session is None
            else RouteDecision(snap.session.home or "r0", Reason.AFFINITY)
        )
        lease = await s.acquire(d, RouteRequest(sid))
        await s.release(
            lease, Completion(ok=True, prompt_tokens=1000, cached_tokens=900, completion_tokens=5)
        )
    calls = _top_level_calls(r)
    r.close()
    assert calls == {"cmdstat_evalsha": 3 * n}  # snapshot + acquire + release, nothing else


# ---- degraded mode -------------------------------------------------------------------------------


async def _route_once(store: StateStore, sid: str, rid: str) -> str:
    snap = await store.snapshot(sid)
    home = snap.session.home if snap.session else None
    d = RouteDecision(home, Reason.AFFINITY) if home else bind(sid, rid)
    lease = await store.acquire(d, RouteRequest(sid))
    await store.release(lease, Completion(ok=True, prompt_tokens=10, completion_tokens=1))
    return lease.replica_id


@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_no_redis_at_start_then_it_appears(clock: VirtualClock, refresh: float) -> None:
    port = free_port()
    made: list[RedisStore] = []
    s = new_store(
        made,
        f"redis://127.0.0.1:{port}/0",
        clock,
        op_timeout_s=0.2,
        retry_max_s=0.1,
        replica_refresh_s=refresh,
    )
    await s.upsert_replica(spec("r0"), A)  # queued for Redis, applied to the local mirror
    await s.upsert_replica(spec("r1"), A)
    t0 = time.monotonic()
    assert await _route_once(s, "a", "r1") == "r1"
    assert await _route_once(s, "a", "r0") == "r1"  # the local binding holds while degraded
    assert time.monotonic() - t0 < 2.0
    assert s.degraded and s.degraded_total == 1 and s.fallback_total >= 4
    server = RedisServer(port=port).start()
    try:
        deadline = time.monotonic() + 5
        while s.degraded:
            assert time.monotonic() < deadline, s.stats()
            await asyncio.sleep(0.05)
        assert s.resync_total == 1
        other = new_store(made, server.url, clock, "g2")
        assert [r.id for r in await other.replicas()] == ["r0", "r1"]  # registry writes replayed
        sess = await other.session("a")
        assert sess is not None and sess.home == "r1"  # the binding made meanwhile was republished
        assert (await other.replicas())[1].in_flight == 0
        for st in made:
            await st.close()
    finally:
        server.cleanup()


async def test_engine_session_pins_are_shared_and_survive_an_outage(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    g1 = new_store(stores, redis_url, clock, "g1", op_timeout_s=0.15, retry_min_s=0.05, retry_max_s=0.1)
    g2 = new_store(stores, redis_url, clock, "g2")
    await g1.pin(PinKind.ENGINE_SESSION, "e1", "r0")
    assert await g2.pinned(PinKind.ENGINE_SESSION, "e1") == "r0"  # another gateway finds it
    await g2.unpin(PinKind.ENGINE_SESSION, "e1")
    assert await g1.pinned(PinKind.ENGINE_SESSION, "e1") is None  # and its close is everyone's
    await g1.pin(PinKind.ENGINE_SESSION, "e2", "r1")
    r = aioredis.Redis.from_url(redis_url)
    await r.execute_command("CLIENT", "PAUSE", "800", "ALL")  # type: ignore[no-untyped-call]
    assert await g1.pinned(PinKind.ENGINE_SESSION, "e2") == "r1"  # served from what this gateway knows
    assert g1.degraded
    await g1.pin(PinKind.ENGINE_SESSION, "e3", "r0")  # kept locally while Redis is away
    assert await g1.pinned(PinKind.ENGINE_SESSION, "e3") == "r0"
    await r.aclose()


@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_slow_redis_degrades_quickly_and_recovers(redis_url, stores, clock, refresh) -> None:  # type: ignore[no-untyped-def]
    s = new_store(
        stores,
        redis_url,
        clock,
        op_timeout_s=0.15,
        retry_min_s=0.05,
        retry_max_s=0.1,
        replica_refresh_s=refresh,
    )
    await s.upsert_replica(spec("r0"), A)
    assert await _route_once(s, "x", "r0") == "r0"
    r = aioredis.Redis.from_url(redis_url)
    await r.execute_command("CLIENT", "PAUSE", "800", "ALL")  # type: ignore[no-untyped-call]  # Redis stalls 0.8 s
    t0 = time.monotonic()
    assert await _route_once(s, "x", "r0") == "r0"  # served from local state, home remembered
    assert time.monotonic() - t0 < 0.75  # did not wait out the 0.8 s pause
    assert s.degraded and s.degraded_total == 1
    deadline = time.monotonic() + 5
    while s.degraded:
        assert time.monotonic() < deadline, s.stats()
        await asyncio.sleep(0.05)
    assert await _route_once(s, "x", "r0") == "r0"
    snap = await s.snapshot("x")
    assert snap.replicas[0].in_flight == 0 and snap.session is not None and snap.session.in_flight == ()
    await r.aclose()


@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_leases_outstanding_across_an_outage_are_counted_exactly(
    redis_killable: RedisServer, clock: VirtualClock, refresh: float
) -> None:
    made: list[RedisStore] = []
    s = new_store(
        made, redis_killable.url, clock, op_timeout_s=0.2, retry_max_s=0.1, replica_refresh_s=refresh
    )
    await s.upsert_replica(spec("r0"), A)
    before = [await s.acquire(bind("s", "r0"), RouteRequest("s")) for _ in range(4)]
    redis_killable.kill()
    during = await s.acquire(RouteDecision("r0", Reason.AFFINITY), RouteRequest("s"))
    await s.release(before[0], Completion(ok=False))  # ended while Redis was away
    assert s.degraded
    redis_killable.start()
    deadline = time.monotonic() + 5
    while s.degraded:
        assert time.monotonic() < deadline, s.stats()
        await asyncio.sleep(0.05)
    other = new_store(made, redis_killable.url, clock, "g2")
    snap = await other.snapshot("s")
    # Redis came back empty; the gateway republished the replica, the home and its 3 live leases
    assert [(r.id, r.in_flight) for r in snap.replicas] == [("r0", 3)]
    assert snap.session is not None and snap.session.home == "r0" and snap.session.in_flight == (("r0", 3),)
    for lease in (*before[1:], during):
        await s.release(lease, Completion(ok=False))
    assert (await other.replicas())[0].in_flight == 0
    for st in made:
        await st.close()


async def test_a_lease_released_while_the_resync_restores_is_not_counted_again(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    """Redis stalls (keeps its data); the store degrades. A lease that ends while the resync's restore
    is on the wire is released locally: the restore carried it (its counts were taken before), so a
    second restore must follow. It did not: the first one cleared the request for it on return, and
    Redis kept the lease counted on the replica and on the session for good."""
    s = new_store(stores, redis_url, clock, op_timeout_s=0.1, retry_min_s=0.05, retry_max_s=0.1)
    other = new_store(stores, redis_url, clock, "g2")
    await s.upsert_replica(spec("r0"), A)
    await s.start()
    first = await s.acquire(bind("a", "r0"), RouteRequest("a"))
    second = await s.acquire(RouteDecision("r0", Reason.AFFINITY), RouteRequest("b"))
    r = aioredis.Redis.from_url(redis_url)
    await r.execute_command("CLIENT", "PAUSE", "300", "ALL")  # type: ignore[no-untyped-call]
    await s.snapshot(None)  # times out: degraded
    assert s.degraded
    deadline = time.monotonic() + 5
    while s._gate.is_set():  # the resync's restore is in flight
        assert time.monotonic() < deadline, s.stats()
        await asyncio.sleep(0)
    assert s.degraded
    await s.release(first, Completion(ok=False))
    deadline = time.monotonic() + 5
    while True:
        snap = await other.snapshot("a")
        if not s.degraded and snap.replicas[0].in_flight == 1 and snap.session and not snap.session.in_flight:
            break
        assert time.monotonic() < deadline, (snap.replicas, snap.session, s.stats())
        await asyncio.sleep(0.05)
    await s.release(second, Completion(ok=False))
    snap = await other.snapshot("a")
    assert snap.replicas[0].in_flight == 0 and snap.session is not None and snap.session.in_flight == ()
    await r.aclose()


# ---- fast path: local replica table + session cache (replica_refresh_s > 0) ----------------------


async def test_two_round_trips_per_request_on_the_fast_path(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    s = new_store(stores, redis_url, clock, config=StoreConfig(lease_ttl_s=3600), replica_refresh_s=3600.0)
    for i in range(4):
        await s.upsert_replica(spec(f"r{i}"), A)
    await s.start()
    for i in range(10):  # this gateway learns the 10 sessions (new: 3 round trips each)
        await _route_once(s, f"s{i}", f"r{i % 4}")
    r = redis.Redis.from_url(redis_url)
    r.config_resetstat()
    rt0 = s.round_trips_total
    n = 50
    for i in range(n):
        sid = f"s{i % 10}"
        snap = await s.snapshot(sid)
        assert snap.session is not None and snap.session.home == f"r{i % 10 % 4}"
        assert snap.session.context_tokens == (11 if i < 10 else 1005)  # learnt from release replies
        lease = await s.acquire(RouteDecision(snap.session.home, Reason.AFFINITY), RouteRequest(sid))
        assert lease.replica_id == snap.session.home and not lease.disagreement
        await s.release(
            lease, Completion(ok=True, prompt_tokens=1000, cached_tokens=900, completion_tokens=5)
        )
    assert _top_level_calls(r) == {"cmdstat_evalsha": 2 * n}  # acquire + release, nothing else
    r.config_resetstat()
    for i in range(5):  # sessions new to this gateway: one more (the session read) each
        await _route_once(s, f"new{i}", "r0")
    assert _top_level_calls(r) == {"cmdstat_evalsha": 3 * 5}
    r.close()
    assert s.round_trips_total - rt0 == 2 * n + 3 * 5
    assert s.session_cache_misses == 15 and s.stale_total == 0


async def test_fast_path_own_load_is_exact_others_arrive_with_the_refresh(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    g1 = new_store(stores, redis_url, clock, "g1", replica_refresh_s=0.05)
    g2 = new_store(stores, redis_url, clock, "g2")
    await g1.upsert_replica(spec("r0"), A)
    await g1.snapshot(None)  # the table is read once
    mine = [await g1.acquire(bind("a", "r0"), RouteRequest("a")) for _ in range(3)]
    snap = await g1.snapshot("a")  # no refresh needed: our own load is never stale
    assert snap.replicas[0].in_flight == 3 and snap.session is not None
    assert snap.session.in_flight == (("r0", 3),) and snap.session.home == "r0"
    theirs = [await g2.acquire(RouteDecision("r0", Reason.AFFINITY), RouteRequest("a")) for _ in range(2)]

    async def until(n_rep: int, n_sess: int) -> None:
        deadline = time.monotonic() + 3
        while True:
            snap = await g1.snapshot(None)
            if snap.replicas[0].in_flight == n_rep:
                break
            assert time.monotonic() < deadline, (snap.replicas, g1.stats())
            await asyncio.sleep(0.02)

    await until(5, 0)
    for lease in mine:
        await g1.release(lease, Completion(ok=False))
    snap = await g1.snapshot("a")
    assert snap.replicas[0].in_flight == 2  # our releases count at once
    assert snap.session is not None and snap.session.in_flight == (("r0", 2),)  # from the release reply
    for lease in theirs:
        await g2.release(lease, Completion(ok=False))
    await until(0, 0)
    assert g1.refresh_total >= 2 and g1.degraded_total == 0


async def test_fast_path_follows_a_session_another_gateway_moved(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    g1 = new_store(stores, redis_url, clock, "g1", replica_refresh_s=3600.0)
    g2 = new_store(stores, redis_url, clock, "g2")
    for rid in ("r0", "r1", "r2"):
        await g1.upsert_replica(spec(rid), A)
    assert await _route_once(g1, "s", "r0") == "r0"
    move = RouteDecision(
        "r1", Reason.REASSIGNED_OVERLOAD, (BindSession("s", "r1", "r0", Reason.REASSIGNED_OVERLOAD),)
    )
    await g2.release(await g2.acquire(move, RouteRequest("s")), Completion(ok=False))
    snap = await g1.snapshot("s")
    assert snap.session is not None and snap.session.home == "r0"  # g1's cached view is stale
    lease = await g1.acquire(RouteDecision("r0", Reason.AFFINITY), RouteRequest("s"))
    assert lease.replica_id == "r1" and lease.disagreement  # the script followed the real home
    await g1.release(lease, Completion(ok=True, prompt_tokens=50, completion_tokens=5))
    assert (await g1.snapshot("s")).session.home == "r1"  # type: ignore[union-attr]
    # moved again, to a replica that is not active: nothing is applied, the caller re-routes
    move2 = RouteDecision(
        "r2", Reason.REASSIGNED_OVERLOAD, (BindSession("s", "r2", "r1", Reason.REASSIGNED_OVERLOAD),)
    )
    await g2.release(await g2.acquire(move2, RouteRequest("s")), Completion(ok=False))
    await g2.set_status("r2", ReplicaStatus.DRAINING)
    with pytest.raises(StaleSessionError):
        await g1.acquire(RouteDecision("r1", Reason.AFFINITY), RouteRequest("s"))
    snap = await g1.snapshot("s")
    assert snap.session is not None and snap.session.home == "r2" and snap.session.in_flight == ()
    assert [(r.id, r.in_flight) for r in await g2.replicas()] == [("r0", 0), ("r1", 0), ("r2", 0)]
    assert g1.stale_total == 1
    # a decision that binds the session itself is judged by the compare-and-set, as on the old path
    back = RouteDecision(
        "r0", Reason.REASSIGNED_DRAINING, (BindSession("s", "r0", "r2", Reason.REASSIGNED_DRAINING),)
    )
    lease = await g1.acquire(back, RouteRequest("s"))
    assert lease.replica_id == "r0" and not lease.disagreement
    await g1.release(lease, Completion(ok=False))
    assert (await g2.session("s")).home == "r0"  # type: ignore[union-attr]


async def test_fast_path_sees_its_own_registry_writes_at_once(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    g1 = new_store(stores, redis_url, clock, "g1", replica_refresh_s=3600.0)
    await g1.upsert_replica(spec("r0"), A)
    assert [(r.id, r.status) for r in await g1.replicas()] == [("r0", A)]
    await g1.upsert_replica(spec("r1"))
    await g1.set_status("r0", ReplicaStatus.DOWN)
    assert [(r.id, r.status) for r in await g1.replicas()] == [
        ("r0", ReplicaStatus.DOWN),
        ("r1", ReplicaStatus.JOINING),
    ]
    await g1.remove_replica("r0")
    assert [r.id for r in await g1.replicas()] == ["r1"]
    rt = g1.round_trips_total
    await g1.replicas()
    assert g1.round_trips_total == rt  # a fresh table costs nothing


async def test_fast_path_reads_a_large_table_in_parts(redis_url, stores, clock) -> None:  # type: ignore[no-untyped-def]
    """Rule 1b of the fast path: a table larger than ``rows_per_refresh`` is read in parts; every
    read brings everyone's in-flight, the rest of a row arrives within ``parts`` reads, a change of
    membership reads the whole table, and our own placements count once, before and after the rows
    that saw them arrive."""
    g1 = new_store(stores, redis_url, clock, "g1", replica_refresh_s=0.02, rows_per_refresh=2)
    g2 = new_store(stores, redis_url, clock, "g2")
    for i in range(6):
        await g2.upsert_replica(spec(f"r{i}"), A)
    await g1.snapshot(None)

    async def until(check: Callable[[dict[str, ReplicaState]], bool]) -> dict[str, ReplicaState]:
        deadline = time.monotonic() + 5
        while True:
            snap = await g1.snapshot(None)
            assert snap.totals == fleet_totals(snap.replicas)  # kept, not scanned, on every snapshot
            reps = {r.id: r for r in snap.replicas}
            if check(reps):
                return reps
            assert time.monotonic() < deadline, (reps, g1.stats())
            await asyncio.sleep(0.01)

    theirs = [await g2.acquire(RouteDecision(f"r{i}", Reason.AFFINITY), RouteRequest(f"t{i}")) for i in range(6)]
    await until(lambda reps: all(r.in_flight == 1 for r in reps.values()))
    assert g1.stats()["partial_refresh_total"] > 0
    await g2.report_engine_load("r5", EngineLoad(running=7, updated_at=clock.now()))
    await until(lambda reps: reps["r5"].engine.running == 7)
    await g2.upsert_replica(spec("r6"), A)
    await until(lambda reps: "r6" in reps)
    await g2.remove_replica("r0")
    await until(lambda reps: "r0" not in reps and len(reps) == 6)
    # our own placement: counted at once, and once
    lease = await g1.acquire(bind("a", "r4"), RouteRequest("a"))
    snap = await g1.snapshot(None)
    assert snap.totals == fleet_totals(snap.replicas)
    reps = {r.id: r for r in snap.replicas}
    assert reps["r4"].placed_recent == 1 and reps["r4"].in_flight == 2 and reps["r4"].sessions_active == 1
    n = g1.stats()["partial_refresh_total"]
    await until(lambda _: g1.stats()["partial_refresh_total"] >= n + 8)
    reps = {r.id: r for r in (await g1.snapshot(None)).replicas}
    assert reps["r4"].placed_recent == 1 and reps["r4"].in_flight == 2 and reps["r4"].sessions_active == 1
    await g1.release(lease, Completion(ok=False))
    for t in theirs[1:]:
        await g2.release(t, Completion(ok=False))
    await until(lambda reps: all(r.in_flight == 0 for r in reps.values()))
    assert g1.degraded_total == 0


def test_gateway_refresh_setting_config_then_env_then_default() -> None:
    from router.errors import ConfigError
    from router.store.redis import GATEWAY_REPLICA_REFRESH_S, REFRESH_ENV, gateway_refresh_s

    class Settings:
        replica_refresh_s = 0.2

    class WithField:
        store = Settings()

    class Without:
        store = object()

    assert gateway_refresh_s(WithField(), {REFRESH_ENV: "0.7"}) == 0.2  # a config field wins
    assert gateway_refresh_s(Without(), {REFRESH_ENV: "0.05"}) == 0.05
    assert gateway_refresh_s(Without(), {}) == GATEWAY_REPLICA_REFRESH_S
    for bad in ("fast", "-1", "61"):
        with pytest.raises(ConfigError, match=REFRESH_ENV):
            gateway_refresh_s(Without(), {REFRESH_ENV: bad})
