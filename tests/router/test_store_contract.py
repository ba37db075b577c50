"""One contract suite for every ``StateStore``: ``MemoryStore`` (the reference), ``RedisStore`` on a real
redis-server, and ``RedisStore`` on a local 3-node Redis Cluster (skipped with the reason if the cluster
cannot be started). A differential test drives random operation sequences through the memory and Redis
stores side by side and requires identical snapshots after every step.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import pytest

from router.clock import VirtualClock
from router.errors import ReplicaNotFoundError
from router.model import (
    MAX_CHAINS,
    BindSession,
    Completion,
    EngineLoad,
    HealthStamp,
    PinKind,
    Reason,
    ReplicaSpec,
    ReplicaStatus,
    RouteDecision,
    RouteRequest,
    SessionState,
    SetOverflow,
    remember_chain,
)
from router.store.base import StateStore, StoreConfig
from router.store.memory import MemoryStore
from router.store.redis import RedisStore

A = ReplicaStatus.ACTIVE


@dataclass
class Env:
    clock: VirtualClock
    make: Callable[..., Awaitable[StateStore]]
    kind: str


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    async for e in _env(request, request.param):
        yield e


@pytest.fixture(params=["redis", "redis-cluster"])
async def shared_env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """The stores several gateways share (a memory store is one gateway's, and the reference)."""
    async for e in _env(request, request.param):
        yield e


async def _env(request: pytest.FixtureRequest, kind: str) -> AsyncIterator[Env]:
    url = None
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
    elif kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster_url")
    clock = VirtualClock(1000.0)
    created: list[StateStore] = []

    async def make(config: StoreConfig | None = None, gateway_id: str | None = None) -> StateStore:
        store: StateStore
        if url is None:
            store = MemoryStore(clock, config)
        else:
            store = RedisStore.from_url(url, gateway_id, config, clock, epoch_offset_s=0.0, op_timeout_s=5.0)
        created.append(store)
        return store

    yield Env(clock, make, kind)
    for s in created:
        if isinstance(s, RedisStore):
            assert s.degraded_total == 0, f"redis store degraded during a contract test: {s.last_error}"
        await s.close()


def spec(rid: str, **kw: object) -> ReplicaSpec:
    return ReplicaSpec(id=rid, url=f"http://{rid}", **kw)  # type: ignore[arg-type]


def bind(sid: str, rid: str, only_if: str | None = None, reason: Reason = Reason.PLACED_NEW) -> RouteDecision:
    return RouteDecision(replica_id=rid, reason=reason, effects=(BindSession(sid, rid, only_if, reason),))


def plain(rid: str, reason: Reason = Reason.AFFINITY) -> RouteDecision:
    return RouteDecision(replica_id=rid, reason=reason)


def done(prompt: int, cached: int = 0, completion: int = 10, ok: bool = True) -> Completion:
    return Completion(ok=ok, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion)


async def fleet(env: Env, n: int = 3, config: StoreConfig | None = None) -> StateStore:
    store = await env.make(config)
    for i in range(n):
        await store.upsert_replica(spec(f"r{i}", capacity_tokens=1000 * (i + 1)), A)
    return store


# ---- registry ------------------------------------------------------------------------------------


async def test_registry_lifecycle(env: Env) -> None:
    store = await env.make()
    await store.upsert_replica(spec("a", model="m"))
    (a,) = await store.replicas()
    assert (a.id, a.url, a.status, a.joined_at, a.model) == ("a", "http://a", ReplicaStatus.JOINING, 0.0, "m")
    env.clock.advance(5)
    await store.set_status("a", A)
    assert (await store.replicas())[0].joined_at == 1005.0
    env.clock.advance(5)
    await store.set_status("a", ReplicaStatus.DRAINING)
    await store.set_status("a", A)
    (a,) = await store.replicas()
    assert a.status is A and a.joined_at == 1005.0  # joined_at is the *first* activation
    await store.upsert_replica(spec("a", model="m2"))  # no status: keeps ACTIVE
    (a,) = await store.replicas()
    assert (a.status, a.model) == (A, "m2")
    await store.upsert_replica(spec("b"), A)
    assert [r.id for r in await store.replicas()] == ["a", "b"]
    await store.remove_replica("a")
    assert [r.id for r in await store.replicas()] == ["b"]
    with pytest.raises(ReplicaNotFoundError):
        await store.set_status("a", A)
    await store.remove_replica("nope")  # removing an unknown replica is a no-op


async def test_engine_load_and_capacity_fallback(env: Env) -> None:
    store = await env.make()
    await store.upsert_replica(spec("a"), A)
    await store.upsert_replica(spec("b", capacity_tokens=7, host_capacity_tokens=9), A)
    load = EngineLoad(running=3, queued=2, kv_util=0.5, capacity_tokens=500, host_capacity_tokens=900,
                      cache_hit_rate=0.75, gen_throughput=123.5, updated_at=1000.25)  # fmt: skip
    await store.upsert_replica(spec("c", capacity_tokens=7, host_capacity_tokens=9), A)
    await store.report_engine_load("a", load)
    await store.report_engine_load("b", load)
    await store.report_engine_load("ghost", load)  # unknown: ignored
    a, b, c = await store.replicas()
    assert a.engine == load and (a.capacity_tokens, a.host_capacity_tokens) == (500, 900)
    # one precedence rule (router.model.capacities): the engine's own report wins over a
    # registration's figures, which stand only while the engine says nothing
    assert (b.capacity_tokens, b.host_capacity_tokens) == (500, 900)
    assert (c.capacity_tokens, c.host_capacity_tokens) == (7, 9)


async def test_shared_health_checks_of_registered_replicas(env: Env) -> None:
    """Discovery rule 7's store half: good checks are kept per registered replica (the latest write
    wins), read back in the writer's clock, and go with the replica; a stamp of an unknown replica is
    dropped, so a replica removed while a round was in flight leaves nothing behind."""
    store = await env.make()
    await store.upsert_replica(spec("a"), A)
    await store.upsert_replica(spec("b"), A)
    assert await store.health_stamps() == {}
    await store.report_health({"a": HealthStamp(1000.25, "gw-1/x", 2.5), "ghost": HealthStamp(1000.5, "gw-1/x", 2.5)})
    await store.report_health({"b": HealthStamp(1000.5, "sidecar:b", 2.5)})
    await store.report_health({"a": HealthStamp(1000.75, "gw-2/y", 2.5)})
    assert await store.health_stamps() == {"a": HealthStamp(1000.75, "gw-2/y", 2.5), "b": HealthStamp(1000.5, "sidecar:b", 2.5)}
    await store.remove_replica("a")
    await store.upsert_replica(spec("a"), A)  # registered again: a new replica, checked by nobody yet
    assert await store.health_stamps() == {"b": HealthStamp(1000.5, "sidecar:b", 2.5)}


# ---- hot path ------------------------------------------------------------------------------------


async def test_first_bind_counts_and_accounting(env: Env) -> None:
    store = await fleet(env)
    snap = await store.snapshot("s1")
    assert snap.session is None and snap.seq == 0 and snap.now == 1000.0
    lease = await store.acquire(bind("s1", "r1"), RouteRequest("s1"))
    assert (lease.replica_id, lease.session_id, lease.disagreement, lease.prev_context_tokens) == (
        "r1",
        "s1",
        False,
        0,
    )
    assert lease.reason is Reason.PLACED_NEW and lease.acquired_at == 1000.0
    snap = await store.snapshot("s1")
    r1 = snap.replica("r1")
    assert r1 is not None
    assert (r1.in_flight, r1.sessions_active, r1.placed_recent, r1.capacity_tokens) == (1, 1, 1, 2000)
    assert snap.seq == 1 and snap.sessions_active == 1
    s = snap.session
    assert s is not None and s.home == "r1" and s.in_flight == (("r1", 1),) and s.last_seen == 1000.0
    env.clock.advance(2)
    await store.release(lease, done(1000, 0, 20))
    snap = await store.snapshot("s1")
    r1 = snap.replica("r1")
    assert r1 is not None and (r1.in_flight, r1.tokens_written, r1.active_context_tokens) == (0, 1020, 1020)
    s = snap.session
    assert s is not None
    assert (s.context_tokens, s.turns, s.residency_mark, s.in_flight, s.last_seen) == (
        1020,
        1,
        1020,
        (),
        1002.0,
    )


async def test_compare_and_set_first_bind_loses_to_existing_home(env: Env) -> None:
    store = await fleet(env)
    l1 = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    l2 = await store.acquire(bind("s", "r2"), RouteRequest("s"))  # raced: another gateway bound first
    assert (l1.replica_id, l1.disagreement) == ("r0", False)
    assert (l2.replica_id, l2.disagreement) == ("r0", True)
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.home == "r0" and snap.session.in_flight == (("r0", 2),)
    r2 = snap.replica("r2")
    assert r2 is not None and (r2.in_flight, r2.placed_recent, r2.sessions_active) == (0, 0, 0)


async def test_reassign_moves_active_accounting(env: Env) -> None:
    store = await fleet(env)
    lease = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    await store.release(lease, done(500))
    env.clock.advance(1)
    lease = await store.acquire(
        bind("s", "r2", only_if="r0", reason=Reason.REASSIGNED_OVERLOAD), RouteRequest("s")
    )
    assert (lease.replica_id, lease.disagreement, lease.prev_context_tokens) == ("r2", False, 510)
    snap = await store.snapshot("s")
    r0, r2 = snap.replica("r0"), snap.replica("r2")
    assert r0 is not None and r2 is not None
    assert (r0.sessions_active, r0.active_context_tokens) == (0, 0)
    assert (r2.sessions_active, r2.active_context_tokens, r2.placed_recent) == (1, 510, 1)
    assert snap.session is not None and snap.session.residency_mark == 0 and snap.session.home == "r2"
    # a stale reassignment (only_if no longer true) is refused and keeps r2
    lease2 = await store.acquire(
        bind("s", "r1", only_if="r0", reason=Reason.REASSIGNED_OVERLOAD), RouteRequest("s")
    )
    assert (lease2.replica_id, lease2.disagreement) == ("r2", True)


async def test_overflow_split_and_context_learning(env: Env) -> None:
    store = await fleet(env)
    home = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    split = RouteDecision("r1", Reason.THICC_SPLIT, effects=(SetOverflow("s", ("r0", "r1")),))
    over = await store.acquire(split, RouteRequest("s"))
    assert over.replica_id == "r1"
    snap = await store.snapshot("s")
    assert snap.session is not None
    assert snap.session.overflow == ("r1",)  # the home never appears among overflow replicas
    assert snap.session.in_flight == (("r0", 1), ("r1", 1))
    await store.release(over, done(9000))  # not home: teaches nothing about the session's context
    snap = await store.snapshot("s")
    assert snap.session is not None and (snap.session.context_tokens, snap.session.turns) == (0, 0)
    await store.release(home, done(800, completion=0))
    snap = await store.snapshot("s")
    assert snap.session is not None and (snap.session.context_tokens, snap.session.turns) == (800, 1)
    # the parent's turn and a sub-agent's at home: the sub-agent finishing last does not shrink the
    # session's context to its own (the parent's is still at home and comes back)
    a = await store.acquire(plain("r0"), RouteRequest("s"))
    b = await store.acquire(plain("r0"), RouteRequest("s"))
    await store.release(a, done(2000, completion=0))
    await store.release(b, done(1500, completion=0))
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.context_tokens == 2000
    a = await store.acquire(plain("r0"), RouteRequest("s"))
    await store.release(a, done(900, completion=0))  # alone, but the larger context was just seen
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.context_tokens == 2000
    b = await store.acquire(plain("r0"), RouteRequest("s"))
    await store.release(b, done(1600, ok=False))  # failed: no learning
    snap = await store.snapshot("s")
    assert snap.session is not None and (snap.session.context_tokens, snap.session.turns) == (2000, 4)
    # a compaction: once the larger context has not been seen for a whole active window, a smaller
    # one replaces it
    env.clock.advance(StoreConfig().active_window_s + 1)
    a = await store.acquire(plain("r0"), RouteRequest("s"))
    await store.release(a, Completion(ok=True, prompt_tokens=700, cached_tokens=0, completion_tokens=0,
                                      prompt_bytes=2870))
    snap = await store.snapshot("s")
    assert snap.session is not None and (snap.session.context_tokens, snap.session.turns) == (700, 5)
    assert snap.session.bytes_per_token == pytest.approx(4.1)  # learned from the turn's body and usage
    # n = 3 outputs of one prompt (usage sums them): all three are written to the cache, but the
    # conversation goes on from one of them
    written = next(r.tokens_written for r in snap.replicas if r.id == "r0")
    a = await store.acquire(plain("r0"), RouteRequest("s"))
    await store.release(a, Completion(ok=True, prompt_tokens=900, cached_tokens=700, completion_tokens=300,
                                      samples=3))  # fmt: skip
    snap = await store.snapshot("s")
    assert snap.session is not None and (snap.session.context_tokens, snap.session.turns) == (1000, 6)
    assert next(r.tokens_written for r in snap.replicas if r.id == "r0") == written + 200 + 300
    # clearing overflow
    lease = await store.acquire(
        RouteDecision("r0", Reason.AFFINITY, (SetOverflow("s", ()),)), RouteRequest("s")
    )
    await store.release(lease, Completion(ok=False))
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.overflow == ()


async def test_where_each_conversation_last_ran(env: Env) -> None:
    """``SessionState.chains``: per conversation key, the replica its last request went to, newest
    last, at most ``MAX_CHAINS`` (``remember_chain``); a request without a key records nothing."""
    store = await fleet(env)
    first = await store.acquire(bind("s", "r0"), RouteRequest("s", chain_key="parent"))
    sub = await store.acquire(
        RouteDecision("r1", Reason.THICC_SPLIT, (SetOverflow("s", ("r1",)),)), RouteRequest("s", chain_key="sub")
    )
    await store.acquire(plain("r0"), RouteRequest("s"))
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.chains == (("parent", "r0"), ("sub", "r1"))
    assert snap.session.chain_at("sub") == "r1" and snap.session.chain_at("other") is None
    await store.release(sub, done(900))
    await store.release(first, done(2000))
    again = await store.acquire(plain("r2"), RouteRequest("s", chain_key="parent"))  # moved to the newest end
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.chains == (("sub", "r1"), ("parent", "r2"))
    await store.release(again, done(2100))
    expected = snap.session.chains
    for i in range(MAX_CHAINS):
        lease = await store.acquire(plain("r0"), RouteRequest("s", chain_key=f"c{i}"))
        await store.release(lease, done(100))
        expected = remember_chain(expected, f"c{i}", "r0")
    snap = await store.snapshot("s")
    assert snap.session is not None and snap.session.chains == expected
    assert len(expected) == MAX_CHAINS and expected[0] == ("c0", "r0")


async def test_release_is_idempotent_and_never_negative(env: Env) -> None:
    store = await fleet(env)
    lease = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    other = await store.acquire(plain("r0", Reason.LEAST_LOADED), RouteRequest(None))
    await store.release(lease, done(100, cached=40, completion=5))
    await store.release(lease, done(100, cached=40, completion=5))
    r0 = (await store.snapshot(None)).replica("r0")
    assert r0 is not None and (r0.in_flight, r0.tokens_written) == (1, 65)
    await store.release(other, Completion(ok=False))
    await store.release(other, Completion(ok=False))
    r0 = (await store.snapshot(None)).replica("r0")
    assert r0 is not None and r0.in_flight == 0


async def test_unknown_target_raises_replica_not_found(env: Env) -> None:
    store = await fleet(env)
    with pytest.raises(ReplicaNotFoundError):
        await store.acquire(plain("nope"), RouteRequest("s"))
    r = await store.replicas()
    assert sum(x.in_flight for x in r) == 0


async def test_windows_prune_active_and_placements(env: Env) -> None:
    cfg = StoreConfig(active_window_s=60, ramp_window_s=10, session_ttl_s=600)
    store = await fleet(env, config=cfg)
    lease = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    await store.release(lease, done(300, completion=0))
    env.clock.advance(9.5)
    r0 = (await store.snapshot(None)).replica("r0")
    assert r0 is not None and (r0.placed_recent, r0.sessions_active) == (1, 1)
    env.clock.advance(1)
    r0 = (await store.snapshot(None)).replica("r0")
    assert r0 is not None and (r0.placed_recent, r0.sessions_active, r0.active_context_tokens) == (0, 1, 300)
    env.clock.advance(50)
    snap = await store.snapshot("s")
    r0 = snap.replica("r0")
    assert r0 is not None and (r0.sessions_active, r0.active_context_tokens) == (0, 0)
    assert snap.sessions_active == 0
    assert snap.session is not None and snap.session.home == "r0"  # still bound, just not active
    # a new turn makes it active again with its known context
    lease = await store.acquire(plain("r0"), RouteRequest("s"))
    r0 = (await store.snapshot(None)).replica("r0")
    assert r0 is not None and (r0.sessions_active, r0.active_context_tokens) == (1, 300)
    await store.release(lease, Completion(ok=False))


async def test_session_idle_ttl_forgets_binding(env: Env) -> None:
    cfg = StoreConfig(active_window_s=5, session_ttl_s=30)
    store = await fleet(env, config=cfg)
    lease = await store.acquire(bind("s", "r0"), RouteRequest("s"))
    env.clock.advance(100)  # in flight: never forgotten
    assert (await store.snapshot("s")).session is not None
    await store.release(lease, done(100))
    env.clock.advance(29)
    assert (await store.snapshot("s")).session is not None
    env.clock.advance(2)
    assert (await store.snapshot("s")).session is None
    assert await store.session("s") is None
    lease = await store.acquire(bind("s", "r2"), RouteRequest("s"))  # a fresh first bind
    assert (lease.replica_id, lease.disagreement, lease.prev_context_tokens) == ("r2", False, 0)


async def test_sessions_on_and_session_view(env: Env) -> None:
    store = await fleet(env)
    for i in range(6):
        env.clock.advance(1)
        lease = await store.acquire(bind(f"s{i}", f"r{i % 2}"), RouteRequest(f"s{i}"))
        await store.release(lease, done(100 * (i + 1), completion=0))
    on0 = await store.sessions_on("r0")
    assert [s.session_id for s in on0] == ["s0", "s2", "s4"]
    assert [s.context_tokens for s in on0] == [100, 300, 500]
    assert [s.session_id for s in await store.sessions_on("r0", limit=2)] == ["s2", "s4"]
    assert await store.sessions_on("r2") == ()
    s3 = await store.session("s3")
    assert s3 is not None and (s3.home, s3.context_tokens, s3.turns) == ("r1", 400, 1)
    assert await store.session("unknown") is None
    # moving s0 to r2 moves it between views
    lease = await store.acquire(
        bind("s0", "r2", only_if="r0", reason=Reason.REASSIGNED_DRAINING), RouteRequest("s0")
    )
    await store.release(lease, Completion(ok=False))
    assert [s.session_id for s in await store.sessions_on("r0")] == ["s2", "s4"]
    assert [s.session_id for s in await store.sessions_on("r2")] == ["s0"]


async def test_engine_session_pins(env: Env) -> None:
    """SGLang's engine sessions: pinned to a replica, forgotten after the session TTL without use."""
    store = await fleet(env, config=StoreConfig(session_ttl_s=30.0))
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") is None
    await store.pin(PinKind.ENGINE_SESSION, "e1", "r1")
    await store.pin(PinKind.ENGINE_SESSION, "e2", "r2")
    await store.pin(PinKind.ENGINE_SESSION, "odd|id:{x}", "r0")  # ids are opaque
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") == "r1"
    assert await store.pinned(PinKind.ENGINE_SESSION, "odd|id:{x}") == "r0"
    env.clock.advance(20)
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") == "r1"  # a use restarts its idle time
    env.clock.advance(20)
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") == "r1"
    assert await store.pinned(PinKind.ENGINE_SESSION, "e2") is None  # idle 40 s
    await store.pin(PinKind.ENGINE_SESSION, "e2", "r0")  # opened again elsewhere: the new pin holds
    assert await store.pinned(PinKind.ENGINE_SESSION, "e2") == "r0"
    await store.remove_replica("r1")
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") == "r1"  # outlives its replica: the gateway checks
    await store.unpin(PinKind.ENGINE_SESSION, "e1")
    assert await store.pinned(PinKind.ENGINE_SESSION, "e1") is None
    await store.unpin(PinKind.ENGINE_SESSION, "e1")  # closing twice is no error
    assert await store.pinned(PinKind.ENGINE_SESSION, "e2") == "r0"


async def test_pin_kinds_are_apart(env: Env) -> None:
    """A stored response and an engine session of the same name are two pins: neither finds,
    moves nor drops the other."""
    store = await fleet(env, config=StoreConfig(session_ttl_s=30.0))
    await store.pin(PinKind.RESPONSE, "resp_1", "r1")
    assert await store.pinned(PinKind.ENGINE_SESSION, "resp_1") is None
    await store.pin(PinKind.ENGINE_SESSION, "resp_1", "r2")
    assert await store.pinned(PinKind.RESPONSE, "resp_1") == "r1"
    await store.unpin(PinKind.ENGINE_SESSION, "resp_1")
    assert await store.pinned(PinKind.RESPONSE, "resp_1") == "r1"
    env.clock.advance(31)
    assert await store.pinned(PinKind.RESPONSE, "resp_1") is None  # a response's pin expires too


async def test_a_reservation_goes_to_one_of_racing_callers(env: Env) -> None:
    """``reserve`` pins only a name nobody has pinned: of several callers, on one store or on
    several gateways' stores sharing Redis, exactly one gets it; an unpinned name is free again."""
    store = await fleet(env)
    stores = [store] if env.kind == "memory" else [store, await env.make(gateway_id="gw-2"), await env.make(gateway_id="gw-3")]
    got = await asyncio.gather(*(s.reserve(PinKind.ENGINE_SESSION, "es-1", ",") for s in stores * 3))
    assert sorted(got) == [False] * (len(got) - 1) + [True]
    assert await store.pinned(PinKind.ENGINE_SESSION, "es-1") == ","
    await store.pin(PinKind.ENGINE_SESSION, "es-1", "r1")  # the open's answer settles it
    assert not await stores[-1].reserve(PinKind.ENGINE_SESSION, "es-1", ",")
    assert await stores[-1].reserve(PinKind.RESPONSE, "es-1", "r2")  # another kind, another pin
    await stores[-1].unpin(PinKind.ENGINE_SESSION, "es-1")
    assert await store.reserve(PinKind.ENGINE_SESSION, "es-1", ",")


async def test_request_without_session(env: Env) -> None:
    store = await fleet(env)
    lease = await store.acquire(
        plain("r1", Reason.LEAST_LOADED), RouteRequest(None, prompt_tokens_estimate=50)
    )
    assert lease.session_id is None and lease.prev_context_tokens == 0
    snap = await store.snapshot(None)
    assert snap.session is None and snap.sessions_active == 0
    assert [r.in_flight for r in snap.replicas] == [0, 1, 0]
    await store.release(lease, done(50, completion=5))
    r1 = (await store.snapshot(None)).replica("r1")
    assert r1 is not None and (r1.in_flight, r1.tokens_written) == (0, 55)


async def test_two_gateways_one_truth(shared_env: Env) -> None:
    env = shared_env
    g1 = await fleet(env)
    g2 = await env.make(None, "second-gateway")
    l1 = await g1.acquire(bind("s", "r0"), RouteRequest("s"))
    l2 = await g2.acquire(bind("s", "r1"), RouteRequest("s"))
    assert (l2.replica_id, l2.disagreement) == ("r0", True)
    s1, s2 = await g1.snapshot("s"), await g2.snapshot("s")
    assert s1.replicas == s2.replicas and s1.session == s2.session
    assert s1.session is not None and s1.session.in_flight == (("r0", 2),)
    await g2.release(l2, done(10))
    await g1.release(l1, done(10))
    assert [r.in_flight for r in (await g2.snapshot(None)).replicas] == [0, 0, 0]


# ---- differential: random operation sequences, memory vs Redis ----------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_sequences_match_memory(shared_env: Env, seed: int) -> None:
    env = shared_env
    cfg = StoreConfig(active_window_s=20, ramp_window_s=5, session_ttl_s=10_000)  # TTL: see test above
    ref = MemoryStore(env.clock, cfg)
    sut = await env.make(cfg)
    rng = random.Random(seed)
    rids = [f"r{i}" for i in range(4)]
    for rid in rids[:3]:
        for s in (ref, sut):
            await s.upsert_replica(spec(rid, capacity_tokens=5000), A)
    leases: list[tuple[object, object]] = []
    sids = [f"s{i}" for i in range(12)]
    trace: list[str] = []
    for step in range(250):
        env.clock.advance(rng.choice([0.0, 0.1, 0.5, 2.0, 7.0]))
        op = rng.random()
        if op < 0.45:
            sid = rng.choice([*sids, None])
            snap = await ref.snapshot(sid)
            live = [r.id for r in snap.replicas]
            if not live:
                continue
            target = rng.choice(live)
            effects: list[BindSession | SetOverflow] = []
            reason = Reason.AFFINITY
            if sid is not None and rng.random() < 0.6:
                home = snap.session.home if snap.session else None
                only_if = home if rng.random() < 0.8 else rng.choice([None, *live])
                reason = rng.choice([Reason.PLACED_NEW, Reason.REASSIGNED_OVERLOAD, Reason.AFFINITY])
                effects.append(BindSession(sid, target, only_if, reason))
            if sid is not None and rng.random() < 0.2:
                effects.append(SetOverflow(sid, tuple(rng.sample(live, k=rng.randint(0, len(live))))))
            d = RouteDecision(target, reason, tuple(effects))
            trace.append(f"{step} acquire {sid} {d}")
            chain = rng.choice([None, *(f"k{i}" for i in range(MAX_CHAINS + 3))])  # past the bound
            la = await ref.acquire(d, RouteRequest(sid, chain_key=chain))
            lb = await sut.acquire(d, RouteRequest(sid, chain_key=chain))
            assert replace(lb, lease_id=la.lease_id) == la, f"step {step}"
            leases.append((la, lb))
        elif op < 0.85 and leases:
            la, lb = leases.pop(rng.randrange(len(leases)))
            prompt = rng.randint(100, 20_000)
            c = Completion(ok=rng.random() < 0.9, prompt_tokens=prompt if rng.random() < 0.9 else None,
                           cached_tokens=rng.randint(0, prompt), completion_tokens=rng.randint(0, 300),
                           samples=rng.choice((1, 1, 2, 3)))  # fmt: skip
            await ref.release(la, c)  # type: ignore[arg-type]
            await sut.release(lb, c)  # type: ignore[arg-type]
        elif op < 0.90:
            rid = rng.choice(rids)
            st = rng.choice(list(ReplicaStatus))
            for s in (ref, sut):
                await s.upsert_replica(spec(rid, capacity_tokens=5000), st)
        elif op < 0.93:
            rid = rng.choice(rids)
            load = EngineLoad(running=rng.randint(0, 9), kv_util=rng.random(), updated_at=env.clock.now())
            for s in (ref, sut):
                await s.report_engine_load(rid, load)
        elif op < 0.95 and not leases:
            rid = rng.choice(rids)
            for s in (ref, sut):
                await s.remove_replica(rid)
        sid = rng.choice(sids)
        a, b = await ref.snapshot(sid), await sut.snapshot(sid)
        if a.session is not None and not is_live(a.session, a.now, cfg):
            a = replace(a, session=None)
        assert b.session == a.session, f"step {step}"
        for ra, rb in zip(a.replicas, b.replicas, strict=True):
            assert rb == ra, f"step {step} {ra} {rb}" + "\n".join(trace[-5:])
        assert b == a, f"step {step}"
        rid = rng.choice(rids)
        assert order(await sut.sessions_on(rid)) == order(await ref.sessions_on(rid), a.now, cfg), (
            f"step {step}"
        )


def is_live(s: SessionState, now: float, cfg: StoreConfig) -> bool:
    """Memory prunes idle sessions lazily from the oldest one, so a session idle past the TTL stays
    visible there while an older one is still in flight; Redis hides every idle session at once."""
    return s.last_seen >= now - cfg.session_ttl_s or s.in_flight_total > 0


def order(
    v: tuple[SessionState, ...], now: float | None = None, cfg: StoreConfig | None = None
) -> list[SessionState]:
    """Same sessions in last_seen order (Redis breaks ties by id, memory by touch order)."""
    keep = [s for s in v if now is None or cfg is None or is_live(s, now, cfg)]
    return sorted(keep, key=lambda s: (s.last_seen, s.session_id))


async def test_serving_since_is_the_first_routed_request(env: Env) -> None:
    store = await fleet(env)
    assert (await store.snapshot(None)).serving_since is None  # nothing routed yet
    env.clock.advance(3)
    await store.acquire(bind("s1", "r0"), RouteRequest("s1"))
    env.clock.advance(2)
    await store.acquire(bind("s2", "r1"), RouteRequest("s2"))
    snap = await store.snapshot(None)
    assert snap.serving_since == pytest.approx(1003.0)
    await store.upsert_replica(spec("r9"), A)  # turns ACTIVE after the first request: a scale-up
    r9 = (await store.snapshot(None)).replica("r9")
    assert r9 is not None and snap.serving_since is not None and r9.joined_at > snap.serving_since


async def test_engine_feedback_moves_the_residency_horizon(env: Env) -> None:
    store = await fleet(env)

    async def turn(sid: str, prompt: int, cached: int, first: bool = False) -> None:
        decision = bind(sid, "r0") if first else plain("r0")
        lease = await store.acquire(decision, RouteRequest(sid))
        await store.release(lease, done(prompt, cached=cached, completion=0))

    async def horizon() -> int:
        r0 = (await store.snapshot(None)).replica("r0")
        assert r0 is not None
        return r0.residency_horizon_tokens

    await turn("s", 800, 0, first=True)  # r0 wrote 800; s's mark = 800
    await turn("t", 5000, 0, first=True)  # written 5,800
    assert await horizon() == 0  # no evidence yet: the policy uses the capacity
    await turn("s", 900, 0)  # s continues its context and finds it gone after 5,000 written
    assert await horizon() == 5000
    await turn("t", 11_000, 5000)  # t finds its own (900 written since): below the horizon, no news
    assert await horizon() == 5000
    await turn("s", 1000, 900)  # s finds its cache still there after 6,000 written: the horizon rises
    assert await horizon() == 6000
    await turn("u", 100, 0, first=True)  # a first turn is no evidence
    await turn("s", 200, 0)  # nor a prompt that does not continue s's context (a sub-agent's)
    assert await horizon() == 6000
    await turn("t", 11_500, 11_000)  # 500 more written
    await turn("s", 1100, 0)  # a miss after 600 written: implausible for a 6,000-token horizon
    assert await horizon() == 6000
    await turn("s", 1200, 900)  # half a hit is no clear evidence either way
    assert await horizon() == 6000


async def test_a_session_only_the_engines_know_is_in_the_snapshot_with_its_residency(env: Env) -> None:
    """An unknown session key whose blocks the KV events name: the snapshot carries it without a
    home, with ``resident_on`` filled (the policy sends it back to its cache); nothing is stored."""
    from router.residency import ResidencyIndex

    store = await env.make()
    for rid in ("r0", "r1"):
        await store.upsert_replica(spec(rid), ReplicaStatus.ACTIVE)
    idx = ResidencyIndex()
    for rid in ("r0", "r1"):
        idx.replica(rid).cleared()  # complete: every block known
    idx.replica("r1").stored(None, [11, 12], 16, 32, 1, "lost")
    idx.replica("r0").reset_incomplete()  # its engine's replay no longer starts at sequence 0
    idx.replica("r0").stored(999, [21], 16, 16, 1, "old")  # below a block never seen: depth unknown
    store.residency = idx  # type: ignore[attr-defined]
    snap = await store.snapshot("lost")
    assert snap.session is not None and snap.session.home is None and snap.session.resident_on == (("r1", 32),)
    snap = await store.snapshot("old")  # an incomplete mirror holds its last stored block (rule 7)
    assert snap.session is not None and (snap.session.resident_on, snap.session.tip_on) == ((), ("r0",))
    assert (await store.snapshot("never-seen")).session is None
    assert await store.session("lost") is None
    # the policy sends it back to its cache, and that binds it like any first bind
    d = bind("lost", "r1", reason=Reason.PLACED_RESIDENT)
    lease = await store.acquire(d, RouteRequest("lost", prompt_tokens_estimate=100))
    assert (lease.replica_id, lease.reason, lease.disagreement) == ("r1", Reason.PLACED_RESIDENT, False)
    await store.release(lease, done(100, cached=32))
    s = await store.session("lost")
    assert s is not None and s.home == "r1"


async def test_the_shared_policy_config_has_a_generation(env: Env) -> None:
    """``PATCH /admin/config`` shares the whole config through the store; a reader names the
    generation it has and gets the document only when there is a newer one. On Redis every
    gateway of the store sees it; the memory store serves one gateway."""
    store = await env.make()
    assert await store.shared_config(0) == (0, None)
    assert await store.share_config('{"policy":"kv_aware","params":{"thicc_threshold":5}}') == 1
    assert await store.shared_config(0) == (1, '{"policy":"kv_aware","params":{"thicc_threshold":5}}')
    assert await store.shared_config(1) == (1, None)
    assert await store.share_config('{"policy":"hash","params":{}}') == 2
    if env.kind != "memory":
        other = await env.make(gateway_id="gw-other")
        assert await other.shared_config(1) == (2, '{"policy":"hash","params":{}}')
        assert await other.share_config("{}") == 3 and await store.shared_config(2) == (3, "{}")
