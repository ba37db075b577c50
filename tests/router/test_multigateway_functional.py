"""Several gateways on one Redis, as separate processes (each a ``RedisStore`` with its own gateway id,
driving the real ``kv_aware`` policy), against a real redis-server:

- 200 new sessions sent concurrently through 3 gateways each end with exactly one home;
- in-flight totals are exact under load, and a SIGKILLed gateway's load is gone once its lease expires;
- Redis killed under load: no operation fails, degradation is counted; Redis back: bindings resync.

The worker half of this file runs as ``python -m tests.router.test_multigateway_functional ...``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from router.clock import SystemClock
from router.model import BindSession, Completion, ReplicaSpec, ReplicaStatus, RouteDecision, RouteRequest
from router.policy.registry import make_policy
from router.store.base import StoreConfig
from router.store.redis import RedisStore

ROOT = Path(__file__).resolve().parents[2]
REPLICAS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
LEASE_TTL_S = 3.0  # short for the SIGKILL test, long enough for a starved process on a busy CI box


def _config(prefix: str = "kvroute") -> StoreConfig:
    return StoreConfig(lease_ttl_s=LEASE_TTL_S, key_prefix=prefix)


async def _register(store: RedisStore) -> None:
    for rid in REPLICAS:
        await store.upsert_replica(ReplicaSpec(id=rid, url=f"http://{rid}", capacity_tokens=400_000),
                                   ReplicaStatus.ACTIVE)  # fmt: skip


# ---- worker process ------------------------------------------------------------------------------


async def _worker_race(
    url: str, gid: str, sids: list[str], start_at: int, seed: int, refresh: float
) -> dict[str, object]:
    """Place every session concurrently, each with this gateway's own (random) view of the fleet."""
    store = RedisStore.from_url(
        url, gid, _config(), SystemClock(), op_timeout_s=5.0, replica_refresh_s=refresh
    )
    policy = make_policy("kv_aware")
    rng = random.Random(seed)
    await store.start()
    parties = int(start_at)

    async def barrier(name: str) -> None:
        await store.client.incr(name)
        deadline = time.time() + 60
        while int(await store.client.get(name) or 0) < parties and time.time() < deadline:
            await asyncio.sleep(0.002)

    # the worst race there is: every gateway decides on every session while it is still unbound,
    # then all of them try to bind at once
    await store.snapshot(None)
    await barrier("test-barrier-decide")
    decisions = []
    for sid in sids:
        req = RouteRequest(sid, prompt_tokens_estimate=1000)
        decisions.append((req, policy.route(req, await store.snapshot(sid), rng)))
    await barrier("test-barrier-bind")

    async def one(req: RouteRequest, d: RouteDecision) -> tuple[str, tuple[str, str, bool, list[str]], bool]:
        lease = await store.acquire(d, req)
        await asyncio.sleep(rng.random() * 0.05)
        await store.release(
            lease, Completion(ok=True, prompt_tokens=1000, cached_tokens=0, completion_tokens=5)
        )
        binds = [e for e in d.effects if isinstance(e, BindSession)]
        first = any(e.only_if is None for e in binds)
        return (
            req.session_key or "",
            (lease.replica_id, lease.reason.value, first, [e.replica_id for e in binds]),
            lease.disagreement,
        )

    res = await asyncio.gather(*(one(req, d) for req, d in decisions))
    out = {"served": {s: r for s, r, _ in res}, "disagreements": sum(d for *_, d in res),
           "degraded_total": store.degraded_total, "last_error": store.last_error}  # fmt: skip
    await store.close()
    return out


async def _worker_hold(url: str, gid: str, n: int, seed: int, refresh: float) -> None:
    """Hold ``n`` leases on random replicas, report them, release on a line from stdin."""
    store = RedisStore.from_url(
        url, gid, _config(), SystemClock(), op_timeout_s=5.0, replica_refresh_s=refresh
    )
    policy = make_policy("kv_aware")
    rng = random.Random(seed)
    await store.start()
    held: dict[str, int] = {}
    leases = []
    for i in range(n):
        req = RouteRequest(f"{gid}-s{i % 7}", prompt_tokens_estimate=500)
        d = policy.route(req, await store.snapshot(req.session_key), rng)
        lease = await store.acquire(d, req)
        leases.append(lease)
        held[lease.replica_id] = held.get(lease.replica_id, 0) + 1
    print(json.dumps({"held": held}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for lease in leases:
        await store.release(lease, Completion(ok=True, prompt_tokens=500, completion_tokens=1))
    print(json.dumps({"released": len(leases), "degraded_total": store.degraded_total}), flush=True)
    await store.close()


def _worker_main(argv: list[str]) -> int:
    mode, url, gid = argv[0], argv[1], argv[2]
    if mode == "race":
        sids = argv[3].split(",")
        out = asyncio.run(_worker_race(url, gid, sids, int(argv[4]), int(argv[5]), float(argv[6])))
        print(json.dumps(out), flush=True)
    elif mode == "hold":
        asyncio.run(_worker_hold(url, gid, int(argv[3]), int(argv[4]), float(argv[5])))
    return 0


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.router.test_multigateway_functional", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """``_spawn``, with every worker still running killed at teardown: a worker left holding leases
    after a failed assertion would put its load into the next tests on the session's Redis."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        procs.append(_spawn(*args))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_200_new_sessions_through_3_gateways_each_end_with_one_home(
    redis_url: str, refresh: float, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    admin = RedisStore.from_url(redis_url, "admin", _config(), SystemClock(), op_timeout_s=5.0)
    await _register(admin)
    sids = [f"race-{i}" for i in range(200)]
    start_at = 3  # processes to wait for at the barrier: all three start placing at the same moment
    procs = [
        spawn("race", redis_url, f"gw{i}", ",".join(sids), str(start_at), str(i), str(refresh))
        for i in range(3)
    ]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=60)
        assert p.returncode == 0, stdout
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for sid in sids:
        s = await admin.session(sid)
        assert s is not None and s.home in REPLICAS and s.in_flight == ()
        served = [o["served"][sid] for o in outs]
        # every gateway that tried a first bind (compare-and-set on "unbound") ended on ONE replica
        first_binds = {replica for replica, _, first, _ in served if first}
        assert len(first_binds) == 1, f"{sid}: {served}"
        moved = [b for _, _, first, binds in served if not first for b in binds]
        assert s.home in first_binds or s.home in moved, f"{sid}: home {s.home}, {served}"
    assert all(o["degraded_total"] == 0 for o in outs)
    # every gateway decided on an unbound session: per session one bind won, two lost and were redirected
    assert all(first for o in outs for _, _, first, _ in o["served"].values())
    assert sum(int(o["disagreements"]) for o in outs) == 2 * len(sids)
    snap = await admin.snapshot(None)
    assert sum(r.in_flight for r in snap.replicas) == 0
    assert sum(r.sessions_active for r in snap.replicas) == 200
    await admin.close()


@pytest.mark.slow
@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_inflight_exact_under_load_and_sigkilled_gateway_leaves_no_phantom(
    redis_url: str, refresh: float, spawn: Callable[..., subprocess.Popen[str]]
) -> None:
    admin = RedisStore.from_url(redis_url, "admin", _config(), SystemClock(), op_timeout_s=5.0)
    await _register(admin)
    counts = [23, 17, 31]
    procs = [
        spawn("hold", redis_url, f"holder{i}", str(n), str(i), str(refresh)) for i, n in enumerate(counts)
    ]
    helds: list[dict[str, int]] = []
    for p in procs:
        assert p.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, p.stdout.readline)
        helds.append(json.loads(line)["held"])
    total = {rid: sum(h.get(rid, 0) for h in helds) for rid in REPLICAS}
    snap = await admin.snapshot(None)
    assert {r.id: r.in_flight for r in snap.replicas} == total, helds
    assert sum(total.values()) == sum(counts)

    victim = procs[2]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    killed_at = time.monotonic()
    expect = {rid: helds[0].get(rid, 0) + helds[1].get(rid, 0) for rid in REPLICAS}
    while True:
        snap = await admin.snapshot(None)
        if {r.id: r.in_flight for r in snap.replicas} == expect:
            break
        seen = {r.id: r.in_flight for r in snap.replicas}
        assert time.monotonic() - killed_at < LEASE_TTL_S + 2.0, (
            f"phantom load outlived the lease: {seen} {expect}"
        )
        await asyncio.sleep(0.05)
    gone_after = time.monotonic() - killed_at
    assert gone_after <= LEASE_TTL_S + 2.0
    for p in procs[:2]:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("release\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["degraded_total"] == 0
        p.wait(timeout=30)
        assert p.returncode == 0
    snap = await admin.snapshot(None)
    assert all(r.in_flight == 0 for r in snap.replicas)
    # and the dead gateway's per-session in-flight is gone too
    s = await admin.session("holder2-s0")
    assert s is not None and s.in_flight == ()
    await admin.close()


@pytest.mark.slow
@pytest.mark.parametrize("refresh", [0.0, 0.05], ids=["3rt", "fast"])
async def test_redis_killed_under_load_then_back(redis_killable, refresh) -> None:  # type: ignore[no-untyped-def]
    url = redis_killable.url
    stores = [
        RedisStore.from_url(
            url,
            f"g{i}",
            _config(),
            SystemClock(),
            op_timeout_s=0.5,
            retry_max_s=0.2,
            replica_refresh_s=refresh,
        )
        for i in range(3)
    ]
    await _register(stores[0])
    for s in stores:
        await s.start()
        await s.snapshot(None)  # each gateway has seen the fleet once
    policy = make_policy("kv_aware")
    errors: list[BaseException] = []
    served: dict[str, set[str]] = {}
    stop = asyncio.Event()
    ops = 0

    async def client(i: int) -> None:
        nonlocal ops
        rng = random.Random(i)
        turn = 0
        while not stop.is_set():
            sid = f"c{i}-s{turn % 5}" if turn % 3 else f"c{i}-new{turn}"
            store = stores[rng.randrange(3)]
            req = RouteRequest(sid, prompt_tokens_estimate=800)
            try:
                snap = await store.snapshot(sid)
                d = policy.route(req, snap, rng)
                lease = await store.acquire(d, req)
                await asyncio.sleep(0.005)
                await store.release(lease, Completion(ok=True, prompt_tokens=800, completion_tokens=3))
                served.setdefault(sid, set()).add(lease.replica_id)
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                errors.append(exc)
            ops += 1
            turn += 1

    tasks = [asyncio.create_task(client(i)) for i in range(6)]
    await asyncio.sleep(0.5)
    redis_killable.kill()
    ops_at_kill = ops
    await asyncio.sleep(1.5)
    assert errors == []
    assert ops > ops_at_kill + 50, "gateways stopped serving while Redis was down"
    stats = [s.stats() for s in stores]
    assert all(s.degraded for s in stores), stats
    assert all(s.degraded_total >= 1 and s.fallback_total > 0 for s in stores), stats
    outage_sessions = {sid for sid in served if "new" in sid}
    redis_killable.start()  # same port, empty (persistence is off)
    deadline = time.monotonic() + 10
    while any(s.degraded for s in stores):
        assert time.monotonic() < deadline, [s.stats() for s in stores]
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*tasks)
    assert errors == []
    assert all(s.resync_total >= 1 for s in stores)
    # the empty Redis got the fleet back from the gateways' mirrors, and the bindings made meanwhile
    assert [r.id for r in await stores[0].replicas()] == REPLICAS
    republished = [await stores[0].session(sid) for sid in sorted(outage_sessions)]
    assert sum(1 for s in republished if s is not None and s.home in REPLICAS) > 0
    # in-flight converges to exactly zero once the load stops (restored counts, no phantoms); a lease
    # that ended during a resync is dropped from Redis by the restore right after it
    deadline = time.monotonic() + 2
    while True:
        snap = await stores[1].snapshot(None)
        if all(r.in_flight == 0 for r in snap.replicas):
            break
        assert time.monotonic() < deadline, (snap.replicas, [s.stats() for s in stores])
        await asyncio.sleep(0.02)
    for s in stores:
        await s.close()


# ---- through HTTP: 3 `kvroute serve --redis` processes in front of emulated replicas ---------------


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.slow
async def test_three_gateway_processes_share_one_redis_over_http(redis_killable) -> None:  # type: ignore[no-untyped-def]
    import contextlib
    import tempfile

    import aiohttp

    from loadtests.overhead import _body
    from loadtests.peers import _readiness_check, _wait_ready, emulated_fleet
    from loadtests.procs import free_port, start_process, stop_process

    url = redis_killable.url
    body = _body(False)
    with tempfile.TemporaryDirectory(prefix="kvroute-mgw-") as tmp:
        log_dir = Path(tmp)
        async with emulated_fleet(4, ("--time-scale", "0.0005"), log_dir=log_dir) as fleet:
            gateways = []
            try:
                for i in range(3):
                    port = free_port()
                    argv = [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port),
                            "--policy", "kv_aware", "--redis", url]  # fmt: skip
                    for u in fleet.urls:
                        argv += ["--replica", u]
                    p = await start_process(f"gw{i}", argv, log_dir=log_dir)
                    p.url = f"http://127.0.0.1:{port}"
                    gateways.append(p)
                for p in gateways:
                    await _wait_ready(p, _readiness_check(p.url, 4, "kvroute"), 60.0)
                rng = random.Random(7)
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:

                    async def send(gw: str, sid: str) -> tuple[int, str, str]:
                        headers = {"Content-Type": "application/json", "Modal-Session-Id": sid}
                        async with http.post(f"{gw}/v1/chat/completions", data=body, headers=headers) as r:
                            await r.read()
                            return (
                                r.status,
                                r.headers.get("X-Kvroute-Replica", ""),
                                r.headers.get("X-Kvroute-Reason", ""),
                            )

                    # 1. 200 new sessions, each sent at once through two different gateways
                    sids = [f"http-race-{i}" for i in range(200)]
                    pairs = [rng.sample(gateways, 2) for _ in sids]
                    results = await asyncio.gather(
                        *(
                            asyncio.gather(send(a.url, sid), send(b.url, sid))
                            for sid, (a, b) in zip(sids, pairs, strict=True)
                        )
                    )
                    admin = RedisStore.from_url(
                        url, "http-admin", StoreConfig(), SystemClock(), op_timeout_s=5.0
                    )
                    replica_ids = {r.id for r in await admin.replicas()}
                    assert len(replica_ids) == 4
                    split = 0
                    for sid, pair in zip(sids, results, strict=True):
                        assert all(status == 200 for status, _, _ in pair), pair
                        s = await admin.session(sid)
                        assert s is not None and s.home in replica_ids
                        # the policy may split a busy session or move it off an overloaded home at
                        # once (400 requests land together); otherwise both gateways agree on the home
                        moved = [rep for _, rep, reason in pair if reason.startswith("reassigned")]
                        homes = {rep for _, rep, reason in pair if reason in ("placed_new", "affinity")}
                        split += sum(1 for *_, reason in pair if reason == "thicc_split") + len(moved)
                        if moved:
                            assert s.home in moved, f"{sid}: {pair}, home {s.home}"
                        else:
                            assert homes <= {s.home}, f"{sid}: {pair}, home {s.home}"
                    assert split < 100

                    # 2. closed-loop load through random gateways; Redis is killed, then comes back
                    statuses: list[int] = []
                    stop = asyncio.Event()

                    async def user(i: int) -> None:
                        r = random.Random(i)
                        turn = 0
                        while not stop.is_set():
                            sid = f"http-load-{i}" if turn % 4 else f"http-load-{i}-t{turn}"
                            status, _, _ = await send(r.choice(gateways).url, sid)
                            statuses.append(status)
                            turn += 1

                    users = [asyncio.create_task(user(i)) for i in range(8)]
                    await asyncio.sleep(1.0)
                    redis_killable.kill()
                    n_at_kill = len(statuses)
                    await asyncio.sleep(2.0)
                    assert len(statuses) > n_at_kill + 20, "gateways stopped serving while Redis was down"
                    degraded = []
                    for p in gateways:
                        async with http.get(f"{p.url}/metrics", headers={"Accept": "text/plain"}) as r:
                            text = await r.text()
                        degraded.append((_metric(text, "kvroute_store_degraded"),
                                         _metric(text, "kvroute_store_degradations_total")))  # fmt: skip
                    assert all(d == 1.0 and (t or 0) >= 1 for d, t in degraded), degraded
                    redis_killable.start()
                    deadline = time.monotonic() + 20
                    while True:
                        back = []
                        for p in gateways:
                            async with http.get(f"{p.url}/metrics", headers={"Accept": "text/plain"}) as r:
                                back.append(_metric(await r.text(), "kvroute_store_degraded"))
                        if back == [0.0, 0.0, 0.0]:
                            break
                        assert time.monotonic() < deadline, back
                        await asyncio.sleep(0.2)
                    await asyncio.sleep(0.5)
                    stop.set()
                    await asyncio.gather(*users)
                    assert statuses and set(statuses) == {200}, (
                        f"client errors: {[s for s in statuses if s != 200][:5]}"
                    )
                    # Redis came back empty: the gateways republished the fleet and the bindings
                    assert {r.id for r in await admin.replicas()} == replica_ids
                    known = [await admin.session(f"http-load-{i}") for i in range(8)]
                    assert sum(1 for s in known if s is not None and s.home in replica_ids) >= 6
                    # no phantom load: in flight drains to exactly zero (a gateway releases a lease
                    # just after the client has read the response, hence the short wait)
                    deadline = time.monotonic() + 5
                    while sum(r.in_flight for r in await admin.replicas()) != 0:
                        assert time.monotonic() < deadline, await admin.replicas()
                        await asyncio.sleep(0.05)
                    await admin.close()
            finally:
                for p in gateways:
                    with contextlib.suppress(Exception):
                        await stop_process(p)


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
