"""The pure health state machine of discovery, and discovery rounds against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from router.clock import SystemClock
from router.config import HealthConfig, TimeoutsConfig
from router.discovery import Discovery, HealthTrack, ProbeOutcome, health_transition
from router.events import ReplicaActivated, ReplicaEjected, ReplicaReadmitted
from router.gateway.upstream import ReplicaHttpClient
from router.model import EngineLoad, HealthStamp, ReplicaSpec, ReplicaStatus
from router.store.memory import MemoryStore
from tests.router.conftest import EventLog

A, J, D, R = ReplicaStatus.ACTIVE, ReplicaStatus.JOINING, ReplicaStatus.DOWN, ReplicaStatus.DRAINING
CFG = HealthConfig(unhealthy_threshold=3, healthy_threshold=2)


@pytest.mark.parametrize(
    ("status", "track", "ok", "want_track", "want_status"),
    [
        (J, HealthTrack(), True, HealthTrack(1, 0), A),  # first good check activates
        (J, HealthTrack(), False, HealthTrack(0, 1), None),
        (A, HealthTrack(5, 0), False, HealthTrack(0, 1), None),
        (A, HealthTrack(0, 1), False, HealthTrack(0, 2), None),
        (A, HealthTrack(0, 2), False, HealthTrack(0, 3), D),  # third failure in a row
        (A, HealthTrack(0, 2), True, HealthTrack(1, 0), None),  # a success resets the streak
        (D, HealthTrack(0, 4), True, HealthTrack(1, 0), None),
        (D, HealthTrack(1, 0), True, HealthTrack(2, 0), A),  # readmitted after two successes
        (D, HealthTrack(1, 0), False, HealthTrack(0, 1), None),
        (R, HealthTrack(0, 9), False, HealthTrack(0, 10), None),  # draining belongs to the operator
        (R, HealthTrack(), True, HealthTrack(1, 0), None),
    ],
)
def test_health_transition(
    status: ReplicaStatus,
    track: HealthTrack,
    ok: bool,
    want_track: HealthTrack,
    want_status: ReplicaStatus | None,
) -> None:
    assert health_transition(status, track, ok, CFG) == (want_track, want_status)


OK, FAILED, TIMEOUT = ProbeOutcome.OK, ProbeOutcome.FAILED, ProbeOutcome.TIMEOUT


@pytest.mark.parametrize(
    ("status", "track", "outcome", "suspect", "want_track", "want_status"),
    [
        # a timeout alone is "busy": the failure streak stays, a success streak breaks
        (A, HealthTrack(0, 0), TIMEOUT, False, HealthTrack(0, 0, 1), None),
        (A, HealthTrack(0, 2), TIMEOUT, False, HealthTrack(0, 2, 1), None),
        (A, HealthTrack(0, 0, 40), TIMEOUT, False, HealthTrack(0, 0, 41), None),  # never ejects alone
        (D, HealthTrack(1, 0), TIMEOUT, False, HealthTrack(0, 0, 1), None),
        # with evidence (failed requests, or no sign of life for stall_after_s) it counts
        (A, HealthTrack(0, 2), TIMEOUT, True, HealthTrack(0, 3), D),
        (A, HealthTrack(0, 0, 7), TIMEOUT, True, HealthTrack(0, 1), None),
        # an answer other than 200 (or a refused connection) counts whatever the evidence
        (A, HealthTrack(0, 2), FAILED, False, HealthTrack(0, 3), D),
        (A, HealthTrack(0, 1, 3), OK, False, HealthTrack(1, 0), None),
        (J, HealthTrack(), TIMEOUT, False, HealthTrack(0, 0, 1), None),
    ],
)
def test_health_transition_busy_is_not_dead(
    status: ReplicaStatus,
    track: HealthTrack,
    outcome: ProbeOutcome,
    suspect: bool,
    want_track: HealthTrack,
    want_status: ReplicaStatus | None,
) -> None:
    assert health_transition(status, track, outcome, CFG, suspect=suspect) == (want_track, want_status)


async def test_a_slow_health_probe_alone_never_ejects(fake_replicas: Any) -> None:
    """A replica that answers /health later than the probe timeout (as a busy SGLang does) stays ACTIVE
    while it shows signs of life; a failed request, or a long silence, makes the timeouts count."""
    (busy,) = await fake_replicas(1)
    busy.state.health_delay_s = 0.3
    store = MemoryStore(SystemClock())
    await store.upsert_replica(ReplicaSpec(id=busy.id, url=busy.url), ReplicaStatus.ACTIVE)
    log = EventLog()
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=0.1))
    cfg = HealthConfig(unhealthy_threshold=2, healthy_threshold=1, stall_after_s=0.5)
    d = Discovery(store, client, cfg, clock=SystemClock(), emit=log, rng=random.Random(1), probe_timeout_s=0.1)

    async def status() -> ReplicaStatus:
        return {r.id: r.status for r in await store.replicas()}[busy.id]

    try:
        for _ in range(4):
            await d.check_health_once()
            d.on_success(busy.id)  # it keeps answering requests meanwhile
        assert await status() is A and d.health_busy == 4 and d.health_failures == 0
        assert not log.of(ReplicaEjected)

        # evidence: a request to it failed (timed out) since its last success
        d.on_request_failure(busy.id, "timed out")
        await d.check_health_once()
        assert await status() is A
        await d.check_health_once()
        assert await status() is D
        (ej,) = log.of(ReplicaEjected)
        assert ej.cause == "health" and "failed request" in ej.detail

        # back to health; then silence: no request answered, probes timing out for stall_after_s
        busy.state.health_delay_s = 0.0
        await d.check_health_once()
        assert await status() is A
        d.on_success(busy.id)
        busy.state.health_delay_s = 0.3
        await d.check_health_once()
        await d.check_health_once()
        assert await status() is A  # within the stall window: busy
        await asyncio.sleep(0.5)
        await d.check_health_once()
        await d.check_health_once()
        assert await status() is D
        assert "no sign of life" in log.of(ReplicaEjected)[-1].detail
    finally:
        await client.close()


async def test_rounds_against_real_replicas(fake_replicas: Any) -> None:
    up, flaky = await fake_replicas(2)
    clock = SystemClock()
    store = MemoryStore(clock)
    for r in (up, flaky):
        await store.upsert_replica(ReplicaSpec(id=r.id, url=r.url))
    await store.upsert_replica(ReplicaSpec(id="127.0.0.1:9", url="http://127.0.0.1:9"))
    log = EventLog()
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    d = Discovery(
        store,
        client,
        HealthConfig(unhealthy_threshold=2, healthy_threshold=2, eject_on_connect_errors=2),
        clock=clock,
        emit=log,
        rng=random.Random(1),
    )
    try:
        await d.check_health_once()
        states = {r.id: r.status for r in await store.replicas()}
        assert states == {up.id: A, flaky.id: A, "127.0.0.1:9": J}
        assert {e.replica_id for e in log.of(ReplicaActivated)} == {up.id, flaky.id}

        await d.scrape_once()
        eng = {r.id: r.engine for r in await store.replicas()}
        assert (
            eng[up.id].capacity_tokens == 850000 and eng[up.id].kv_util == 0.1 and eng[up.id].updated_at > 0
        )
        assert eng["127.0.0.1:9"].updated_at == 0  # failed scrapes leave nothing
        assert d.scrapes_ok == 2 and d.scrapes_failed == 1

        flaky.state.health_status = 503
        await d.check_health_once()
        assert {r.id: r.status for r in await store.replicas()}[flaky.id] is A
        await d.check_health_once()
        assert {r.id: r.status for r in await store.replicas()}[flaky.id] is D
        (ej,) = log.of(ReplicaEjected)
        assert ej.replica_id == flaky.id and ej.cause == "health" and "503" in ej.detail
        flaky.state.health_status = 200
        await d.check_health_once()
        await d.check_health_once()
        assert {r.id: r.status for r in await store.replicas()}[flaky.id] is A
        assert [e.replica_id for e in log.of(ReplicaReadmitted)] == [flaky.id]

        # passive ejection: two connect errors in a row take an ACTIVE replica down
        await d.on_connect_error(up.id, "refused")
        assert {r.id: r.status for r in await store.replicas()}[up.id] is A
        d.on_success(up.id)
        await d.on_connect_error(up.id, "refused")
        assert {r.id: r.status for r in await store.replicas()}[up.id] is A  # the success reset the count
        await d.on_connect_error(up.id, "refused")
        assert {r.id: r.status for r in await store.replicas()}[up.id] is D
        assert log.of(ReplicaEjected)[-1].cause == "connect"

        # replicas removed from the store are forgotten, draining is left alone
        await store.set_status(flaky.id, R)
        flaky.state.health_status = 500
        for _ in range(3):
            await d.check_health_once()
        assert {r.id: r.status for r in await store.replicas()}[flaky.id] is R
        await store.remove_replica("127.0.0.1:9")
        await d.check_health_once()
        assert "127.0.0.1:9" not in {r.id for r in await store.replicas()}
    finally:
        await client.close()


def _discovery(store: MemoryStore, client: ReplicaHttpClient, cfg: HealthConfig) -> Discovery:
    return Discovery(store, client, cfg, clock=SystemClock(), emit=EventLog(), rng=random.Random(1))


@contextlib.asynccontextmanager
async def _gateways_on_redis(
    urls: list[str], redis_url: str, health: dict[str, Any], *, discovery: tuple[bool, ...] = (True, True),
    apart_s: float = 0.0,
) -> AsyncIterator[list[Any]]:
    """One gateway per entry of ``discovery`` (whether its discovery runs) on one real Redis, started
    ``apart_s`` apart (their rounds at other phases, as gateways started apart are); closed with their
    stores on the way out."""
    from router.gateway.serve import make_store, start_gateway
    from tests.router.conftest import fast_config

    clock = SystemClock()
    gws: list[Any] = []
    try:
        for i, probing in enumerate(discovery):
            cfg = fast_config(urls, redis_url=redis_url, gateway_id=f"gw-{i}", health=health)
            gws.append(await start_gateway(cfg, make_store(cfg, clock), clock=clock, rng=random.Random(i),
                                           discovery=probing))  # fmt: skip
            await asyncio.sleep(apart_s)
        yield gws
    finally:
        for gw in gws:
            await gw.close()
            await gw.store.close()  # made here, not by start_gateway


async def test_the_load_is_read_from_v1_loads_and_metrics_only_for_the_host_tier(fake_replicas: Any) -> None:
    """Rule 4: an engine with ``/v1/loads`` gives its load there every round (core figures only);
    ``/metrics`` is read in the first round and then every ``METRICS_EVERY`` rounds, and its host-tier
    figures stay in the load between. An engine without ``/v1/loads`` (an older one) is read from
    ``/metrics`` every round, as is one whose ``/v1/loads`` stops answering."""
    from router.engine_metrics import METRICS_EVERY

    new, old = await fake_replicas(2)
    new.state.loads = True
    new.state.host_used_tokens = 1000
    store = MemoryStore(SystemClock())
    for r in (new, old):
        await store.upsert_replica(ReplicaSpec(id=r.id, url=r.url))
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    d = _discovery(store, client, HealthConfig())

    async def engine(rid: str) -> EngineLoad:
        return {r.id: r.engine for r in await store.replicas()}[rid]

    try:
        rounds = 2 * METRICS_EVERY + 1
        for i in range(rounds):
            if i == 1:
                new.state.host_used_tokens = 2000  # not seen until /metrics is read again
            await d.scrape_once()
            e = await engine(new.id)
            assert (e.queued, e.kv_util, e.waiting_uncached_tokens, e.cache_hit_rate) == (2, 0.25, 4096, 0.5)
            assert (e.capacity_tokens, e.host_capacity_tokens) == (850000, 1700000)
            assert e.host_used_tokens == (1000 if i < METRICS_EVERY else 2000), i
        assert new.state.loads_at == ["include=core"] * rounds
        assert len(new.state.scraped_at) == 3  # rounds 0, METRICS_EVERY, 2 x METRICS_EVERY
        assert len(old.state.scraped_at) == rounds
        assert (await engine(old.id)).kv_util == 0.1 and d.scrapes_ok == 2 * rounds and d.scrapes_failed == 0
        assert not d.others_live  # a store of one gateway

        new.state.active = 3  # the live figures come from /v1/loads every round
        await d.scrape_once()
        assert (await engine(new.id)).running == 3 and len(new.state.scraped_at) == 3

        new.state.loads = False  # /v1/loads gone: /metrics at once, every round
        for _ in range(2):
            await d.scrape_once()
        assert len(new.state.scraped_at) == 5
        e = await engine(new.id)
        assert (e.kv_util, e.waiting_uncached_tokens, e.host_used_tokens) == (0.1, 0, 2000)
    finally:
        await client.close()


async def test_rounds_start_replicas_evenly_over_the_spread(fake_replicas: Any) -> None:
    """Rule 5: answers of a round reach the event loop one at a time, each replica at its own phase."""
    reps = await fake_replicas(4)
    store = MemoryStore(SystemClock())
    for r in reps:
        await store.upsert_replica(ReplicaSpec(id=r.id, url=r.url))
    order = [r.id for r in await store.replicas()]
    by_id = {r.id: r for r in reps}
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    d = _discovery(store, client, HealthConfig())
    try:
        await d.scrape_once(spread_s=0.4)
        starts = [by_id[rid].state.scraped_at[0] for rid in order]
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert all(0.07 <= g <= 0.2 for g in gaps), gaps  # i/n of 0.4 s apart, in the store's order
        assert d.scrapes_ok == 4
        await d.scrape_once()  # start-up: all at once
        starts = [by_id[rid].state.scraped_at[1] for rid in order]
        assert max(starts) - min(starts) < 0.06, starts
        await d.check_health_once(spread_s=0.4)
        checks = [by_id[rid].state.checked_at[0] for rid in order]
        assert all(0.07 <= b - a <= 0.2 for a, b in itertools.pairwise(checks)), checks
    finally:
        await client.close()


async def test_rounds_start_a_period_apart_however_long_they_take(fake_replicas: Any) -> None:
    """Rule 5: the next round starts one interval after the last one started, not after it ended."""
    (slow,) = await fake_replicas(1)
    slow.state.metrics_delay_s = 0.15
    store = MemoryStore(SystemClock())
    await store.upsert_replica(ReplicaSpec(id=slow.id, url=slow.url))
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    d = _discovery(store, client, HealthConfig(scrape_interval_s=0.2, jitter=0.0, spread=0.0))
    task = asyncio.create_task(d.run_scrape())
    try:
        await asyncio.sleep(1.3)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
    starts = slow.state.scraped_at
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert len(starts) >= 5, starts  # an interval after each round ended would give 3 (0.35 s apart)
    assert all(0.15 <= g <= 0.3 for g in gaps), gaps


async def test_figures_someone_else_wrote_fresh_are_not_scraped_again(fake_replicas: Any) -> None:
    """Rule 6: two gateways on one store (here one ``MemoryStore``, as on one Redis) scrape each
    replica once per interval between them (the latest writer scrapes on); a sidecar's report counts
    as well; figures that age past two intervals are scraped again."""
    reps = await fake_replicas(3)
    store = MemoryStore(SystemClock())
    for r in reps:
        await store.upsert_replica(ReplicaSpec(id=r.id, url=r.url))
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    cfg = HealthConfig(scrape_interval_s=0.25, jitter=0.0)
    a, b = _discovery(store, client, cfg), _discovery(store, client, cfg)
    try:
        await a.scrape_once()
        await b.scrape_once()  # a's figures, fresh: b leaves them
        assert [len(r.state.scraped_at) for r in reps] == [1, 1, 1]
        assert (a.scrapes_ok, b.scrapes_ok, b.scrapes_shared) == (3, 0, 3)
        await a.scrape_once()  # its own figures: a scrapes on
        assert [len(r.state.scraped_at) for r in reps] == [2, 2, 2]
        await asyncio.sleep(0.55)  # a stops: its figures age past two intervals
        await b.scrape_once()
        assert [len(r.state.scraped_at) for r in reps] == [3, 3, 3] and b.scrapes_ok == 3
        # a sidecar reports the first replica's load: neither gateway scrapes it while it is fresh
        (first, *_) = await store.replicas()
        await asyncio.sleep(0.01)
        await store.report_engine_load(first.id, EngineLoad(running=7, updated_at=SystemClock().now()))
        await a.scrape_once()
        await b.scrape_once()
        assert {r.id: len(r.state.scraped_at) for r in reps}[first.id] == 3
        assert {r.id: r.engine.running for r in await store.replicas()}[first.id] == 7
    finally:
        await client.close()


async def test_two_gateways_on_one_redis_scrape_each_replica_once_per_interval(
    fake_replicas: Any, redis_url: str
) -> None:
    """Rule 6 across processes' worth of state: two gateways share a real Redis (engine figures go
    through the fleet clock there and back). Alone, each would scrape every replica every interval;
    together they scrape it about once per interval between them, and both see figures that fresh."""
    reps = await fake_replicas(3)
    interval, window = 0.2, 2.0
    clock = SystemClock()
    health = {"scrape_interval_s": interval, "health_interval_s": 1.0}
    async with _gateways_on_redis([r.url for r in reps], redis_url, health, apart_s=interval / 2) as gws:
        await asyncio.sleep(interval)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(window)
        t1 = loop.time()
        for r in reps:
            n = sum(t0 <= t < t1 for t in r.state.scraped_at)
            assert n <= 1.3 * window / interval, (r.id, n)  # one gateway's worth (10), not two (20: each its own)
            assert n >= 0.6 * window / interval, (r.id, n)  # and still about every interval
        discoveries = [gw.runtime.discovery for gw in gws]
        assert all(d is not None for d in discoveries)
        assert sum(d.scrapes_shared for d in discoveries if d is not None) >= window / interval
        for gw in gws:
            now = clock.now()
            ages = [now - r.engine.updated_at for r in await gw.store.replicas()]
            assert all(age < 2.5 * interval for age in ages), ages


async def test_good_checks_someone_else_shared_are_not_repeated(fake_replicas: Any) -> None:
    """Rule 7: two gateways on one store check each healthy replica once per interval between them
    (the latest writer checks on); a sidecar's shared check counts too; evidence of a gateway's own
    (a failed request, a failed check) makes it check for itself; shared checks age out; a failure
    seen by the checker takes the replica down for everyone."""
    reps = await fake_replicas(3)
    first, second, third = reps
    store = MemoryStore(SystemClock())
    for r in reps:
        await store.upsert_replica(ReplicaSpec(id=r.id, url=r.url))
    client = ReplicaHttpClient(TimeoutsConfig(probe_s=1.0))
    cfg = HealthConfig(health_interval_s=0.25, jitter=0.0, spread=0.0, unhealthy_threshold=2)
    a, b = _discovery(store, client, cfg), _discovery(store, client, cfg)

    def checks() -> list[int]:
        return [len(r.state.checked_at) for r in reps]

    async def status(r: Any) -> ReplicaStatus:
        return {s.id: s.status for s in await store.replicas()}[r.id]

    try:
        await a.check_health_once()  # JOINING -> ACTIVE, a's good checks shared
        await b.check_health_once()  # a's checks, fresh: b leaves them
        assert checks() == [1, 1, 1] and (b.health_shared, a.health_shared) == (3, 0)
        await a.check_health_once()  # its own: a checks on
        assert checks() == [2, 2, 2]
        b.on_request_failure(first.id, "timed out")  # b's own evidence: b checks that one itself
        await b.check_health_once()
        assert checks() == [3, 2, 2]
        # a sidecar shares its check of the third replica: neither gateway checks it while fresh
        await store.report_health({third.id: HealthStamp(SystemClock().now(), "sidecar:3", 0.5)})
        await a.check_health_once()
        await b.check_health_once()
        assert checks()[2] == 2
        # the writer sees a failure: it shares nothing, takes the replica down after two, for everyone
        second.state.health_status = 503
        await a.check_health_once()
        await b.check_health_once()  # a's last good check is still fresh and b has no evidence
        assert await status(second) is A and len(second.state.checked_at) == 4
        await a.check_health_once()
        assert await status(second) is D
        await b.check_health_once()  # DOWN: b checks for itself
        assert len(second.state.checked_at) == 6
        # a stops: its checks age past the window ((2 + spread) x interval) and b checks everything
        await asyncio.sleep(0.55)
        before = checks()
        await b.check_health_once()
        assert [n - m for n, m in zip(checks(), before, strict=True)] == [1, 1, 1]
    finally:
        await client.close()


async def test_two_gateways_on_one_redis_check_each_replica_once_per_interval(
    fake_replicas: Any, redis_url: str
) -> None:
    """Rule 7 across gateways on a real Redis: together they check each replica about once per
    interval (not once each), and a replica that fails is taken down all the same."""
    reps = await fake_replicas(3)
    interval, window = 0.2, 2.0
    health = {"health_interval_s": interval, "scrape_interval_s": 1.0, "unhealthy_threshold": 2}
    async with _gateways_on_redis([r.url for r in reps], redis_url, health, apart_s=interval / 2) as gws:
        await asyncio.sleep(2 * interval)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(window)
        t1 = loop.time()
        for r in reps:
            n = sum(t0 <= t < t1 for t in r.state.checked_at)
            assert n <= 1.3 * window / interval, (r.id, n)  # one gateway's worth (10), not two (20)
            assert n >= 0.6 * window / interval, (r.id, n)
        discoveries = [gw.runtime.discovery for gw in gws]
        assert sum(d.health_shared for d in discoveries if d is not None) >= window / interval
        reps[0].state.health_status = 503
        await asyncio.sleep(6 * interval)
        for gw in gws:
            assert {r.id: r.status for r in await gw.store.replicas()}[reps[0].id] is D


async def test_gateways_on_one_redis_divide_the_probing_between_them(
    fake_replicas: Any, redis_url: str
) -> None:
    """Rule 8: each replica's figures and checks come from its rendezvous pick among the live
    gateways (not from whichever gateway wrote first), and a sidecar's figures are not taken over."""
    from router.policy.hashing import hrw_top
    from tests.router.conftest import wait_for

    reps = await fake_replicas(12)
    interval = 0.2
    clock = SystemClock()
    health = {"health_interval_s": interval, "scrape_interval_s": interval}
    async with _gateways_on_redis([r.url for r in reps], redis_url, health) as gws:
        store = gws[0].store
        probers = await store.probers()
        assert sorted(probers) == sorted(getattr(gw.store, "lease_holder", "") for gw in gws)
        assert [gw.runtime.discovery.writer_id for gw in gws if gw.runtime.discovery] == [
            getattr(gw.store, "lease_holder", "") for gw in gws
        ]
        pick = {r.id: hrw_top(r.id, probers) for r in await store.replicas()}
        assert set(pick.values()) == set(probers)  # both get some (all 12 to one: p = 2 / 4096)
        # each sees the other: rule 8 of the policy then reads the engines' queues too (prefill.py)
        await wait_for(lambda: all(gw.runtime.discovery and gw.runtime.discovery.others_live for gw in gws), 5.0)

        async def picks_probe_them() -> bool:
            # a probe that timed out on this busy box makes the other gateway check for itself once
            # (rule 7), so the store is read until every replica's latest figures and check are its pick's
            by = {rid: st.by for rid, st in (await store.health_stamps()).items()}
            return by == pick and {r.id: r.engine.reported_by for r in await store.replicas()} == pick

        await wait_for(picks_probe_them, 5.0)
        # a sidecar heartbeats one replica's load: no gateway scrapes it while the figures are fresh
        first = reps[0]
        loop = asyncio.get_running_loop()

        async def scrapes_while_reported() -> list[float] | None:
            """Scrapes of ``first`` in a window of heartbeats; None if a gateway served from local
            state meanwhile (a Redis round trip timed out on a busy box: then scraping is right)."""
            fallbacks = [gw.store.fallback_total for gw in gws]
            t0 = loop.time() + 1.5 * interval  # a round that read the table before the first report may still scrape
            while loop.time() < t0 + 3 * interval:
                await store.report_engine_load(first.id, EngineLoad(running=7, updated_at=clock.now()))
                await asyncio.sleep(0.05)
            if [gw.store.fallback_total for gw in gws] != fallbacks:
                return None
            return [t for t in first.state.scraped_at if t >= t0]

        for _ in range(5):  # after a Redis pause of 0.9 s the third window was the first clean one
            scraped = await scrapes_while_reported()
            if scraped is not None:
                break
        assert scraped == []
        (seen,) = [r for r in await store.replicas() if r.id == first.id]
        assert (seen.engine.running, seen.engine.reported_by) == (7, "")


async def test_a_pick_that_does_not_probe_leaves_its_replicas_to_the_others(
    fake_replicas: Any, redis_url: str
) -> None:
    """Rule 8's fallback: a live gateway whose discovery does not run (here: started without it) is
    still the pick of about half the replicas; the other gateway probes them whenever their figures
    and checks have aged out (every two or three intervals), and its own picks every interval."""
    from router.policy.hashing import hrw_top

    reps = await fake_replicas(12)
    interval, window = 0.2, 2.0
    health = {"health_interval_s": interval, "scrape_interval_s": interval}
    async with _gateways_on_redis([r.url for r in reps], redis_url, health, discovery=(True, False)) as gws:
        probers = await gws[0].store.probers()
        idle = getattr(gws[1].store, "lease_holder", "")
        assert len(probers) == 2 and idle in probers
        assert any(hrw_top(r.id, probers) == idle for r in await gws[0].store.replicas())  # none: p = 1 / 4096
        await asyncio.sleep(3 * interval)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.sleep(window)
        t1 = loop.time()
        rounds = window / interval
        for r in reps:
            checked = sum(t0 <= t < t1 for t in r.state.checked_at)
            scraped = sum(t0 <= t < t1 for t in r.state.scraped_at)
            if hrw_top(r.id, probers) == idle:  # aged out first: 2.8 x 1.1 intervals, 2 x 1.1 for figures
                assert checked >= 0.2 * rounds and scraped >= 0.3 * rounds, (r.id, checked, scraped)
            else:
                assert checked >= 0.6 * rounds and scraped >= 0.6 * rounds, (r.id, checked, scraped)
        writer = getattr(gws[0].store, "lease_holder", "")
        assert {st.by for st in (await gws[0].store.health_stamps()).values()} == {writer}
