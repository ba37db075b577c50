"""``python -m loadtests.bench_hotpath``: the gateway's own CPU per request, in-process, no sockets.

One request's state work is timed phase by phase on the embedded store with the real policy and the
real observability hooks (Prometheus metrics + rolling stats, as ``kvroute serve`` registers them):

  snapshot  ``MemoryCore.snapshot`` (replica views, pruning, the session)
  route     ``policy.route`` (kv_aware by default)
  acquire   ``MemoryCore.acquire`` (effects + in flight)
  events    ``RequestRouted`` + ``RequestFinished`` through the emitter and its hooks
  release   ``MemoryCore.release`` (usage learned)

for 8 and 50 replicas, a *known* session (one of ``--sessions`` bound ones, affinity) and a *new*
session (placement). The synchronous core is timed (the async ``MemoryStore`` adds one await that
never suspends). Each cell reports the mean and p50/p99 of every phase in microseconds.

``--cpu`` runs ``kvroute serve`` (a subprocess, in front of one emulated replica) and reports the
gateway process's own CPU time per proxied request (``/proc/<pid>/stat``, Linux) for a fixed number
of requests at c=1 and c=32, JSON and SSE: unlike latency on a shared box, CPU per request barely
moves when other processes compete for the cores.

``--overhead`` also runs ``kvroute bench overhead --targets kvroute`` (c=1 and c=32; one emulated
replica in a subprocess) once and adds its ``added`` block; ``--compare BEFORE AFTER`` prints the
ratios of two saved overhead documents (noisy machines: compare ratios, never single numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loadtests.soak import cpu_s
from router.clock import SystemClock
from router.events import Emitter, Event, RequestFinished, RequestRouted
from router.model import (
    Completion,
    EngineLoad,
    KeySource,
    ReplicaSpec,
    ReplicaStatus,
    RouteRequest,
)
from router.observability.metrics import GatewayMetrics
from router.observability.stats import RollingStats
from router.observability.surface import StatsHook
from router.policy.registry import make_policy
from router.store.memory import MemoryCore

__all__ = ["PHASES", "cli_main", "compare_overhead", "run_cell", "run_cpu", "run_hotpath"]

PHASES = ("snapshot", "route", "acquire", "events", "release")


def _fleet(core: MemoryCore, n: int, rng: random.Random) -> None:
    for i in range(n):
        rid = f"10.0.0.{i + 1}:30000"
        core.upsert_replica(
            ReplicaSpec(id=rid, url=f"http://{rid}", capacity_tokens=500_000), ReplicaStatus.ACTIVE
        )
        core.report_engine_load(
            rid,
            EngineLoad(
                running=rng.randint(0, 8),
                queued=0,
                kv_util=rng.random() * 0.6,
                capacity_tokens=500_000,
                cache_hit_rate=0.8,
                updated_at=core.clock.now(),
            ),
        )


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_cell(
    replicas: int, known: bool, *, requests: int, sessions: int, policy: str = "kv_aware", seed: int = 7
) -> dict[str, Any]:
    """Time ``requests`` sequential requests; returns per-phase mean/p50/p99 in microseconds."""
    rng = random.Random(seed)
    core = MemoryCore(SystemClock())
    pol = make_policy(policy)
    metrics = GatewayMetrics()
    emit = Emitter([metrics, StatsHook(RollingStats())])
    _fleet(core, replicas, rng)
    ns = time.perf_counter_ns

    def one(sid: str, timings: dict[str, list[float]] | None) -> None:
        req = RouteRequest(session_key=sid, key_source=KeySource.HEADER, prompt_tokens_estimate=4000)
        t0 = ns()
        snap = core.snapshot(sid)
        t1 = ns()
        decision = pol.route(req, snap, rng)
        t2 = ns()
        lease = core.acquire(decision, req)
        t3 = ns()
        ev: Event = RequestRouted(
            request_id="r",
            at=t3 / 1e9,
            route=req.route,
            replica_id=lease.replica_id,
            reason=lease.reason,
            key_source=req.key_source,
            session_id=sid,
            scores=decision.scores,
        )
        emit(ev)
        emit(
            RequestFinished(
                request_id="r",
                at=t3 / 1e9,
                route=req.route,
                status=200,
                ok=True,
                stream=False,
                replica_id=lease.replica_id,
                reason=lease.reason,
                key_source=req.key_source,
                session_id=sid,
                ttft_s=0.01,
                e2e_s=0.02,
                prompt_tokens=4000,
                cached_tokens=3950,
                completion_tokens=16,
            )
        )
        t4 = ns()
        core.release(lease, Completion(ok=True, prompt_tokens=4000, cached_tokens=3950, completion_tokens=16))
        t5 = ns()
        if timings is not None:
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5), strict=True):
                timings[name].append((b - a) / 1000.0)

    pool = [f"sess-{i}" for i in range(sessions)]
    for sid in pool:  # bind every known session once (placement), then warm up
        one(sid, None)
    fresh = (f"new-{i}" for i in range(10**9))
    for _ in range(min(200, requests)):
        one(rng.choice(pool) if known else next(fresh), None)
    timings: dict[str, list[float]] = {p: [] for p in PHASES}
    gc.collect()
    for _ in range(requests):
        one(rng.choice(pool) if known else next(fresh), timings)
    totals = [sum(vals) for vals in zip(*(timings[p] for p in PHASES), strict=True)]
    reasons: dict[str, int] = {}
    for sample in next(iter(metrics.decisions.collect())).samples:
        if sample.name.endswith("_total") and sample.value:
            reasons[sample.labels["reason"]] = reasons.get(sample.labels["reason"], 0) + int(sample.value)
    return {
        "replicas": replicas,
        "session": "known" if known else "new",
        "requests": requests,
        "phases_us": {
            p: {
                "mean": round(sum(v) / len(v), 2),
                "p50": round(_pct(v, 0.5), 2),
                "p99": round(_pct(v, 0.99), 2),
            }
            for p, v in timings.items()
        },
        "total_us": {
            "mean": round(sum(totals) / len(totals), 2),
            "p50": round(_pct(totals, 0.5), 2),
            "p99": round(_pct(totals, 0.99), 2),
        },
        "reasons": reasons,
    }


def run_hotpath(
    *, replicas: Sequence[int] = (8, 50), requests: int = 3000, sessions: int = 500, policy: str = "kv_aware"
) -> dict[str, Any]:
    cells = [
        run_cell(n, known, requests=requests, sessions=sessions, policy=policy)
        for n in replicas
        for known in (True, False)
    ]
    return {
        "bench": "hotpath",
        "policy": policy,
        "python": sys.version.split()[0],
        "note": "sequential, in-process, synchronous core; microseconds of CPU per request and phase",
        "cells": cells,
    }


async def _drive(url: str, *, concurrency: int, stream: bool, requests: int) -> int:
    """Send exactly ``requests`` requests with ``concurrency`` workers; returns the failures."""
    import aiohttp

    from loadtests.overhead import _body

    body = _body(stream)
    target = url.rstrip("/") + "/v1/chat/completions"
    left = requests
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def worker(i: int) -> None:
            nonlocal left, errors
            headers = {"Content-Type": "application/json", "Modal-Session-Id": f"cpu-{i}"}
            while left > 0:
                left -= 1
                async with http.post(target, data=body, headers=headers) as r:
                    async for _ in r.content.iter_any():
                        pass
                    errors += r.status != 200

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(concurrency))), timeout=120)
    return errors


async def run_cpu(
    *, requests: int = 3000, concurrencies: Sequence[int] = (1, 32), extra_args: Sequence[str] = ()
) -> dict[str, Any]:
    """Gateway CPU microseconds per request, live (``kvroute serve`` + one emulated replica)."""
    import tempfile

    from loadtests.peers import PEERS, emulated_fleet, running_router

    cells: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-hotpath-") as tmp:
        log_dir = Path(tmp)
        async with (
            emulated_fleet(1, ("--time-scale", "0.000001"), log_dir=log_dir) as fleet,
            running_router(PEERS["kvroute"], fleet.urls, log_dir=log_dir, extra_args=extra_args) as gw,
        ):
            pid = gw.proc.pid
            for c in concurrencies:
                for stream in (False, True):
                    await _drive(gw.url, concurrency=c, stream=stream, requests=min(300, requests))
                    cpu0, t0 = cpu_s(pid), time.perf_counter()
                    errors = await _drive(gw.url, concurrency=c, stream=stream, requests=requests)
                    cpu1, t1 = cpu_s(pid), time.perf_counter()
                    cells[f"c{c}_{'stream' if stream else 'json'}"] = {
                        "requests": requests,
                        "errors": errors,
                        "gateway_cpu_us_per_request": round((cpu1 - cpu0) / requests * 1e6, 1),
                        "req_per_s": round(requests / (t1 - t0), 1),
                    }
    return {"bench": "hotpath-cpu", "cells": cells}


def compare_overhead(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Ratios after/before of two ``bench overhead`` documents (kvroute rows), per cell."""
    out: dict[str, Any] = {}
    name = next((k for k in after.get("added", {}) if k.startswith("kvroute")), None)
    if name is None or name not in before.get("added", {}):
        raise ValueError("both documents need a kvroute target")
    for key, a in after["added"][name].items():
        b = before["added"][name].get(key)
        if b is None:
            continue
        cb, ca = before["cells"][name][key], after["cells"][name][key]
        ratio: Callable[[Any, Any], float | None] = lambda x, y: (
            round(y / x, 3) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else None
        )
        out[key] = {
            "before": {
                "added_p50_ms": b["added_p50_ms"],
                "added_p99_ms": b["added_p99_ms"],
                "req_per_s": cb["req_per_s"],
                "thr_vs_direct": b["throughput_ratio_vs_direct"],
            },
            "after": {
                "added_p50_ms": a["added_p50_ms"],
                "added_p99_ms": a["added_p99_ms"],
                "req_per_s": ca["req_per_s"],
                "thr_vs_direct": a["throughput_ratio_vs_direct"],
            },
            "added_p50_after_over_before": ratio(b["added_p50_ms"], a["added_p50_ms"]),
            "thr_vs_direct_after_over_before": ratio(
                b["throughput_ratio_vs_direct"], a["throughput_ratio_vs_direct"]
            ),
        }
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_hotpath", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, action="append", help="repeat; default 8 and 50")
    p.add_argument("--requests", type=int, default=3000, help="timed requests per cell")
    p.add_argument("--sessions", type=int, default=500, help="known sessions bound before timing")
    p.add_argument("--policy", default="kv_aware")
    p.add_argument("--cpu", action="store_true", help="also measure live gateway CPU per request")
    p.add_argument("--cpu-only", action="store_true", help="only the live CPU measurement")
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `kvroute serve` argument for --cpu/--cpu-only (repeatable), e.g. --gateway-arg=--no-decision-headers",
    )
    p.add_argument(
        "--overhead", action="store_true", help="also run `kvroute bench overhead --targets kvroute`"
    )
    p.add_argument("--duration", type=float, default=2.0, help="--overhead: seconds per cell")
    p.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("BEFORE", "AFTER"),
        help="only print after/before ratios of two saved overhead JSON documents",
    )
    ns = p.parse_args(argv)
    if ns.compare:
        before, after = (json.loads(f.read_text()) for f in ns.compare)
        print(json.dumps({"bench": "overhead-compare", "cells": compare_overhead(before, after)}, indent=2))
        return 0
    if ns.requests < 1 or ns.sessions < 1:
        p.error("--requests and --sessions must be >= 1")
    if ns.cpu_only:
        print(json.dumps(asyncio.run(run_cpu(requests=ns.requests, extra_args=ns.gateway_arg)), indent=2))
        return 0
    doc = run_hotpath(
        replicas=ns.replicas or (8, 50), requests=ns.requests, sessions=ns.sessions, policy=ns.policy
    )
    if ns.cpu:
        doc["cpu"] = asyncio.run(run_cpu(requests=ns.requests, extra_args=ns.gateway_arg))
    if ns.overhead:
        from loadtests.overhead import run_overhead

        ov = asyncio.run(run_overhead(targets=["kvroute"], duration_s=ns.duration))
        doc["overhead"] = {"added": ov["added"], "cells": ov["cells"]}
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
