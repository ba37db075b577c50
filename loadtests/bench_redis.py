"""``kvroute bench redis``: what shared state in Redis costs per request.

Store level: the gateway's hot path without HTTP (snapshot -> real policy -> acquire -> release) in a
closed loop at concurrency 1 and 32, against the memory store, the Redis store on its 3-round-trip path
(``redis``) and on its fast path (``redis_fast``: local replica table refreshed every ``--refresh`` s,
session cache; 2 round trips per request of a known session). Prints JSON:

- ``round_trips_per_request``: client round trips per request, from Redis's own
  ``INFO commandstats`` (calls of EVALSHA/EVAL/SCRIPT; heartbeats included), and
  ``commands_in_scripts_per_request`` (what those scripts ran inside Redis);
- for the fast path also ``refresh_round_trips`` (background table reads) and
  ``hot_path_round_trips_per_request`` (the rest: acquire, release, session reads of sessions new to
  the gateway, heartbeats);
- per concurrency: p50/p99/mean hot-path latency of each store and ``latency_ratio_p50`` /
  ``latency_ratio_mean`` (Redis / memory), plus requests/s.

Gateway level: the same through ``kvroute serve`` (memory, ``--redis``, and ``--redis`` with
``KVROUTE_REDIS_REFRESH_S``).

Without ``--redis`` it starts a private redis-server on a free port (persistence off) and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loadtests.redis_server import RedisServer, RedisUnavailable
from router.clock import SystemClock
from router.model import Completion, Reason, ReplicaSpec, ReplicaStatus, RouteDecision, RouteRequest
from router.policy.registry import make_policy
from router.store.base import StateStore, StoreConfig
from router.store.memory import MemoryStore

__all__ = ["cli_main", "run_bench"]


@contextmanager
def _private_redis() -> Iterator[str]:
    try:
        with RedisServer() as server:
            yield server.url
    except RedisUnavailable as exc:
        raise SystemExit(f"kvroute bench redis: {exc}; pass --redis URL") from exc


_TOP_LEVEL = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_evalsha_ro", "cmdstat_eval_ro", "cmdstat_script")


async def _command_calls(url: str) -> tuple[int, int]:
    """(round trips, commands run inside scripts) so far, from ``INFO commandstats``.

    Commands a script runs are counted in commandstats too, so a round trip is a call of
    EVALSHA / EVAL / SCRIPT (the store sends nothing else); the rest ran inside scripts."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        stats = await r.info("commandstats")
    finally:
        await r.aclose()
    skip = {
        "cmdstat_info",
        "cmdstat_config|resetstat",
        "cmdstat_hello",
        "cmdstat_ping",
        "cmdstat_client|setinfo",
    }
    trips = inner = 0
    for k, v in stats.items():
        if not k.startswith("cmdstat_") or k in skip:
            continue
        if k.split("|")[0] in _TOP_LEVEL:
            trips += int(v["calls"])
        else:
            inner += int(v["calls"])
    return trips, inner


async def _loop(
    store: StateStore, concurrency: int, duration_s: float, replicas: int, seed: int
) -> dict[str, Any]:
    policy = make_policy("kv_aware")
    lat: list[float] = []
    stop_at = time.perf_counter() + duration_s

    async def worker(w: int) -> None:
        rng = random.Random(seed * 1000 + w)
        turn = 0
        while time.perf_counter() < stop_at:
            sid = f"w{w}-s{turn % 4}"  # closed-loop sessions: a few known, each turn grows
            req = RouteRequest(sid, prompt_tokens_estimate=1000 + 100 * turn)
            t0 = time.perf_counter()
            snap = await store.snapshot(sid)
            decision = policy.route(req, snap, rng)
            lease = await store.acquire(decision, req)
            await store.release(
                lease,
                Completion(ok=True, prompt_tokens=1000 + 100 * turn, cached_tokens=900, completion_tokens=8),
            )
            lat.append(time.perf_counter() - t0)
            turn += 1

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    lat.sort()
    return {
        "requests": len(lat),
        "rps": round(len(lat) / duration_s, 1),
        "p50_ms": round(1000 * lat[len(lat) // 2], 3),
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
        "mean_ms": round(1000 * statistics.fmean(lat), 3),
    }


async def _register(store: StateStore, n: int) -> None:
    for i in range(n):
        rid = f"10.0.0.{i + 1}:8000"
        await store.upsert_replica(
            ReplicaSpec(id=rid, url=f"http://{rid}", capacity_tokens=850_000), ReplicaStatus.ACTIVE
        )


async def _redis_case(url: str, c: int, duration_s: float, replicas: int, refresh_s: float) -> dict[str, Any]:
    from router.store.redis import RedisStore

    prefix = f"bench{c}-{refresh_s}-{int(time.time() * 1000)}"
    store = RedisStore.from_url(
        url, f"bench-{c}", StoreConfig(key_prefix=prefix), SystemClock(), replica_refresh_s=refresh_s
    )
    await _register(store, replicas)
    await store.start()
    trips0, inner0 = await _command_calls(url)
    refresh0 = store.refresh_total
    r = await _loop(store, c, duration_s, replicas, seed=c)
    trips1, inner1 = await _command_calls(url)
    calls, inner = trips1 - trips0, inner1 - inner0
    refreshes = store.refresh_total - refresh0
    degraded = store.degraded_total
    stats = store.stats()
    await store.close()
    n = max(1, r["requests"])
    out = {
        **r,
        "round_trips": calls,
        "round_trips_per_request": round(calls / n, 3),
        "commands_in_scripts_per_request": round(inner / n, 1),
        "degraded_total": degraded,
    }
    if refresh_s > 0:
        out |= {
            "refresh_s": refresh_s,
            "refresh_round_trips": refreshes,
            "hot_path_round_trips_per_request": round((calls - refreshes) / n, 3),
            "session_cache_misses": stats["session_cache_misses"],
            "stale_total": stats["stale_total"],
        }
    return out


async def _evalsha_usec(url: str) -> tuple[int, int]:
    """(script calls, microseconds Redis spent in them) so far, from ``INFO commandstats``."""
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        stats = await r.info("commandstats")
    finally:
        await r.aclose()
    calls = usec = 0
    for k, v in stats.items():
        if k.split("|")[0] in _TOP_LEVEL:
            calls, usec = calls + int(v["calls"]), usec + int(v["usec"])
    return calls, usec


async def _table_refresh_cost(
    url: str, replicas: int, refresh_s: float, *, inflight: int = 0, reads: int = 40, idle_s: float = 3.0
) -> dict[str, Any]:
    """What reading the replica table costs Redis's one thread: one whole read (the snapshot script
    without a session), and an idle fast-path gateway's background refreshes over ``idle_s`` (read in
    parts on a large fleet, docs/REDIS.md): the share of Redis each gateway takes whatever its own
    traffic. Every replica has engine figures, as live; ``inflight`` requests are held open by ten
    other gateways meanwhile (every refresh reads everyone's in-flight)."""
    from router.model import EngineLoad
    from router.store.redis import RedisStore

    clock = SystemClock()
    cfg = StoreConfig(key_prefix=f"benchtable-{int(time.time() * 1000)}")
    store = RedisStore.from_url(url, "bench-table", cfg, clock)
    await _register(store, replicas)
    for r in await store.replicas():
        await store.report_engine_load(r.id, EngineLoad(running=3, kv_util=0.5, capacity_tokens=850_000,
                                                        updated_at=clock.now()))  # fmt: skip
    await store.start()
    await store.snapshot(None)
    calls0, usec0 = await _evalsha_usec(url)
    t0 = time.perf_counter()
    for _ in range(reads):
        await store.snapshot(None)
    client_s = (time.perf_counter() - t0) / reads
    calls1, usec1 = await _evalsha_usec(url)
    out: dict[str, Any] = {
        "replicas": replicas,
        "redis_ms_per_whole_read": round((usec1 - usec0) / max(1, calls1 - calls0) / 1000, 3),
        "gateway_ms_per_whole_read": round(1000 * client_s, 3),
    }
    holders = [RedisStore.from_url(url, f"bench-holder-{g}", cfg, clock) for g in range(10 if inflight else 0)]
    for h in holders:
        await h.start()
    ids = [r.id for r in await store.replicas()] if holders else []
    for i in range(inflight):  # spread over the replicas and the holders, as a loaded fleet's are
        await holders[i % len(holders)].acquire(RouteDecision(ids[(7 * i) % len(ids)], Reason.AFFINITY),
                                                RouteRequest(f"held-{i}"))  # fmt: skip
    out["inflight_held"] = inflight
    if refresh_s > 0:
        fast = RedisStore.from_url(url, "bench-table-fast", cfg, clock, replica_refresh_s=refresh_s)
        await fast.start()
        await fast.snapshot(None)
        await asyncio.sleep(refresh_s * 3)
        calls0, usec0 = await _evalsha_usec(url)
        t0, n0 = time.perf_counter(), fast.refresh_total
        await asyncio.sleep(idle_s)
        calls1, usec1 = await _evalsha_usec(url)
        took, n = time.perf_counter() - t0, fast.refresh_total - n0
        stats = fast.stats()
        await fast.close()
        share = (usec1 - usec0) / 1e6 / took  # the lease heartbeat included: it is what a gateway costs
        out |= {
            "refresh_s": refresh_s,
            "refreshes_per_s": round(n / took, 1),
            "partial_refreshes": stats["partial_refresh_total"],
            "redis_share_per_idle_gateway": round(share, 4),
            "gateways_to_half_a_redis": round(0.5 / share, 1) if share > 0 else None,
        }
    for h in holders:
        await h.close()  # their leases go with them
    await store.close()
    return out


async def run_bench(
    url: str, concurrencies: list[int], duration_s: float, replicas: int, refresh_s: float = 0.05,
    table_inflight: int = 0,
) -> dict[str, Any]:
    out: dict[str, Any] = {"level": "store", "replicas": replicas,
                           "duration_s_per_case": duration_s, "cases": {}}  # fmt: skip
    total_req = 0
    total_calls = 0
    for c in concurrencies:
        mem = MemoryStore(SystemClock(), StoreConfig())
        await _register(mem, replicas)
        m = await _loop(mem, c, duration_s, replicas, seed=c)
        r = await _redis_case(url, c, duration_s, replicas, 0.0)
        total_req += r["requests"]
        total_calls += r["round_trips"]
        case: dict[str, Any] = {
            "memory": m,
            "redis": r,
            "latency_ratio_p50": round(r["p50_ms"] / max(m["p50_ms"], 1e-9), 2),
            "latency_ratio_mean": round(r["mean_ms"] / max(m["mean_ms"], 1e-9), 2),
        }
        if refresh_s > 0:
            f = await _redis_case(url, c, duration_s, replicas, refresh_s)
            case["redis_fast"] = f
            case["fast_latency_ratio_p50"] = round(f["p50_ms"] / max(m["p50_ms"], 1e-9), 2)
            case["fast_latency_ratio_mean"] = round(f["mean_ms"] / max(m["mean_ms"], 1e-9), 2)
        out["cases"][f"c{c}"] = case
    out["round_trips_per_request"] = round(total_calls / max(1, total_req), 3)
    out["table_refresh"] = await _table_refresh_cost(url, replicas, refresh_s, inflight=table_inflight)
    return out


async def _count_requests(url: str, n: int) -> None:
    """``n`` sequential requests over a few sessions (for an exact round-trip count)."""
    import aiohttp

    from loadtests.overhead import _body

    body = _body(False)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        for i in range(n):
            headers = {"Content-Type": "application/json", "Modal-Session-Id": f"count-{i % 8}"}
            async with http.post(url.rstrip("/") + "/v1/chat/completions", data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"gateway answered {r.status} during the round-trip count")


async def run_gateway_bench(
    url: str,
    concurrencies: list[int],
    duration_s: float,
    replicas: int,
    count_requests: int = 200,
    refresh_s: float = 0.05,
) -> dict[str, Any]:
    """The same comparison through ``kvroute serve`` (memory vs ``--redis``) in front of emulated
    replicas answering in ~no modelled time, measured with ``kvroute bench overhead``'s client."""
    from pathlib import Path

    from loadtests.overhead import measure_cell
    from loadtests.peers import _readiness_check, _wait_ready, emulated_fleet, find_binary
    from loadtests.procs import free_port, start_process, stop_process

    out: dict[str, Any] = {"level": "gateway", "replicas": replicas, "duration_s_per_case": duration_s,
                           "cases": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvroute-bench-redis-gw-") as tmp:
        log_dir = Path(tmp)
        async with emulated_fleet(replicas, ("--time-scale", "0.000001"), log_dir=log_dir) as fleet:
            binary = find_binary("kvroute") or "kvroute"
            results: dict[str, dict[str, Any]] = {}
            stores = ("memory", "redis", "redis_fast") if refresh_s > 0 else ("memory", "redis")
            for store in stores:
                port = free_port()
                refresh = refresh_s if store == "redis_fast" else 0.0
                argv = [binary, "serve", "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
                for u in fleet.urls:
                    argv += ["--replica", u]
                if store != "memory":
                    argv += ["--redis", url]
                proc = await start_process(
                    f"kvroute-{store}", argv, log_dir=log_dir, env={"KVROUTE_REDIS_REFRESH_S": str(refresh)}
                )
                gw = f"http://127.0.0.1:{port}"
                try:
                    await _wait_ready(proc, _readiness_check(gw, replicas, "kvroute"), 60.0)
                    cells = {}
                    for c in concurrencies:
                        cells[f"c{c}"] = await measure_cell(
                            gw, concurrency=c, stream=False, fresh=False, duration_s=duration_s
                        )
                    if store != "memory":
                        t0, i0 = await _command_calls(url)
                        c0 = time.perf_counter()
                        await _count_requests(gw, count_requests)
                        took = time.perf_counter() - c0
                        t1, i1 = await _command_calls(url)
                        key = "" if store == "redis" else "fast_"
                        out[f"{key}round_trips_per_request"] = round((t1 - t0) / count_requests, 3)
                        out[f"{key}commands_in_scripts_per_request"] = round((i1 - i0) / count_requests, 1)
                        if refresh:
                            # background table reads at 1/refresh per second, whatever the traffic
                            out["fast_refresh_round_trips_estimate"] = round(took / refresh)
                        out["round_trip_note"] = (
                            "EVALSHA/EVAL/SCRIPT calls during sequential requests; includes the gateway's "
                            "lease heartbeat, any registry writes of its health/metrics loops and, on the "
                            "fast path, its background table refresh"
                        )
                    results[store] = cells
                finally:
                    await stop_process(proc)
            for c in concurrencies:
                m, r = results["memory"][f"c{c}"], results["redis"][f"c{c}"]
                if "redis_fast" in results:
                    f = results["redis_fast"][f"c{c}"]
                    out.setdefault("fast_cases", {})[f"c{c}"] = {
                        "redis_fast": f,
                        "latency_ratio_p50": round(f["p50_ms"] / m["p50_ms"], 3)
                        if m["p50_ms"] and f["p50_ms"]
                        else None,
                        "latency_ratio_p99": round(f["p99_ms"] / m["p99_ms"], 3)
                        if m["p99_ms"] and f["p99_ms"]
                        else None,
                    }
                out["cases"][f"c{c}"] = {
                    "memory": m,
                    "redis": r,
                    "latency_ratio_p50": round(r["p50_ms"] / m["p50_ms"], 3)
                    if m["p50_ms"] and r["p50_ms"]
                    else None,
                    "latency_ratio_p99": round(r["p99_ms"] / m["p99_ms"], 3)
                    if m["p99_ms"] and r["p99_ms"]
                    else None,
                    "added_p50_ms": round(r["p50_ms"] - m["p50_ms"], 3)
                    if m["p50_ms"] and r["p50_ms"]
                    else None,
                }
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench redis", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", metavar="URL", help="use this Redis (default: start a private one)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per case (bounded: max 60)")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--refresh", type=float, default=0.05,
                   help="fast path: replica-table refresh period in s (0: skip the fast-path cases)")  # fmt: skip
    p.add_argument("--level", choices=["store", "gateway", "both"], default="both",
                   help="store: hot path in-process; gateway: through kvroute serve (subprocesses)")  # fmt: skip
    p.add_argument("--table-inflight", type=int, default=0,
                   help="requests held in flight by ten other gateways while the table's cost is measured")  # fmt: skip
    args = p.parse_args(argv)
    if args.table_inflight < 0:
        p.error("--table-inflight must be >= 0")
    duration = min(max(args.duration, 0.2), 60.0)
    refresh = min(max(args.refresh, 0.0), 10.0)

    async def go(url: str) -> dict[str, Any]:
        doc: dict[str, Any] = {"benchmark": "redis"}
        if args.level in ("store", "both"):
            doc["store"] = await run_bench(
                url, args.concurrency, duration, args.replicas, refresh, table_inflight=args.table_inflight
            )
        if args.level in ("gateway", "both"):
            doc["gateway"] = await run_gateway_bench(
                url, args.concurrency, duration, min(args.replicas, 4), refresh_s=refresh
            )
        return doc

    if args.redis:
        result = asyncio.run(go(args.redis))
    else:
        with _private_redis() as url:
            result = asyncio.run(go(url))
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
