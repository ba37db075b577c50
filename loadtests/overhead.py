"""``kvroute bench overhead``: what a router adds on top of talking to the replica directly.

One emulated replica with near-zero modelled time (so the replica answers as fast as Python can) runs
in a subprocess; then, one after another, the client talks to it directly, through kvroute, and through
each peer router that is installed (each router in its own subprocess, one worker behind it, so every
target is directly comparable with "direct"). For c = 1 and c = 32, streaming and not, a closed-loop
client runs for a fixed time and records per-request latency (request sent -> body fully read).

Reported per cell: req/s, p50/p99 latency (ms), errors; per router: added latency
(p50/p99 minus direct's, ms) and the throughput ratio to direct (and to sglang-router where present).

Everything (client, router, replica) shares one machine: read the figures as what one box shows, not
as a router's capacity. sglang-router delays SSE on reused keep-alive connections by ~40 ms (seen on
every version measured here), so streaming cells are run twice: keep-alive and a fresh connection per
request; both are reported.

``--fleet N`` puts N emulated replicas (one process) behind every router, so what a router does per
replica in the background shows in its latency (kvroute scrapes every replica's ``/metrics``);
"direct" and the floor talk to the first.

``--rounds N`` repeats the whole sequence N times (each router started afresh, the targets' order
rotated) and reports medians of each round's figures against that round's own direct cells, their
min-max, and on how many rounds each kvroute target added less than each other router: on a shared
machine whose speed drifts between minutes, one pass compares moments as much as routers.

Target ``python-floor`` (``loadtests/floor_proxy.py``, in the default list) is not a router: a bare
uvloop + httptools proxy with kvroute's upstream client and no logic. Its added latency is what any
Python gateway pays here before doing any work; each router's ``added_over_python_floor_p50_ms`` is the
rest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.bench import emit_json
from loadtests.measures import percentile
from loadtests.peers import PEERS, emulated_fleet, find_binary, running_router

__all__ = ["OVERHEAD_TARGETS", "cli_main", "measure_cell", "run_overhead"]

OVERHEAD_TARGETS: tuple[str, ...] = ("kvroute", "python-floor", "sglang-manual", "vllm-consistent_hash")

_BODY = {
    "model": "default",
    "messages": [
        {"role": "system", "content": "You are a coding agent. " * 8},
        {"role": "user", "content": "Please answer briefly: what does this function return?"},
    ],
    "max_tokens": 16,
    "ignore_eos": True,
}


def _body(stream: bool) -> bytes:
    body: dict[str, Any] = dict(_BODY, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


async def measure_cell(
    url: str, *, concurrency: int, stream: bool, fresh: bool, duration_s: float, warmup_s: float = 0.3
) -> dict[str, Any]:
    """Closed-loop: ``concurrency`` workers send back-to-back requests for ``duration_s``."""
    target = url.rstrip("/") + "/v1/chat/completions"
    body = _body(stream)
    lat: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=fresh)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as http:
        t_begin = time.perf_counter()
        t_measure = t_begin + warmup_s
        t_end = t_measure + duration_s

        async def worker(i: int) -> None:
            nonlocal errors
            sid = f"overhead-{i}"
            headers = {
                "Content-Type": "application/json",
                "Modal-Session-Id": sid,
                "x-session-id": sid,
                "X-SMG-Routing-Key": sid,
            }
            while (t0 := time.perf_counter()) < t_end:
                try:
                    async with http.post(target, data=body, headers=headers) as r:
                        if stream:
                            async for _ in r.content.iter_any():
                                pass
                        else:
                            await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                t1 = time.perf_counter()
                if t0 >= t_measure and t1 <= t_end:
                    if ok:
                        lat.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    p50 = percentile(lat, 50)
    p99 = percentile(lat, 99)
    p999 = percentile(lat, 99.9)
    return {
        "concurrency": concurrency,
        "stream": stream,
        "fresh_connections": fresh,
        "requests": len(lat),
        "errors": errors,
        "req_per_s": len(lat) / duration_s,
        "p50_ms": None if p50 is None else p50 * 1e3,
        "p99_ms": None if p99 is None else p99 * 1e3,
        "p999_ms": None if p999 is None else p999 * 1e3,
        "max_ms": max(lat) * 1e3 if lat else None,
    }


def _cells(concurrencies: Sequence[int]) -> list[tuple[int, bool, bool]]:
    out: list[tuple[int, bool, bool]] = []
    for c in concurrencies:
        out += [(c, False, False), (c, True, False), (c, True, True)]
    return out


def _key(c: int, stream: bool, fresh: bool) -> str:
    return f"c{c}_{'stream' if stream else 'json'}{'_fresh' if fresh else ''}"


async def run_overhead(
    *,
    targets: Sequence[str] = OVERHEAD_TARGETS,
    concurrencies: Sequence[int] = (1, 32),
    duration_s: float = 2.5,
    emulator_args: Sequence[str] = ("--time-scale", "0.000001"),
    fleet: int = 1,
    rounds: int = 1,
    log: Any = None,
) -> dict[str, Any]:
    """Measure every target on one emulated replica; return the JSON document.

    ``fleet`` > 1: the emulator serves that many replicas (one process) and every router gets all
    of them, so what a router does per replica in the background (kvroute scrapes each one's
    ``/metrics``) shows in its latency; "direct" talks to the first.

    ``rounds`` > 1: the whole sequence (direct, then every target, each router started afresh) runs
    that many times, the targets' order rotated each round, and every figure is the median over the
    rounds of what each round measured against its own direct cells (``_summarise_rounds``). On a
    shared machine whose speed drifts over minutes this is what makes two routers comparable."""
    if rounds < 1:
        raise ValueError("rounds: at least 1")
    say = log or (lambda msg: print(msg, file=sys.stderr))
    cells = _cells(concurrencies)
    per_round: list[dict[str, dict[str, Any]]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-overhead-") as tmp:
        log_dir = Path(tmp)
        async with emulated_fleet(fleet, emulator_args, log_dir=log_dir) as replicas:
            replica = replicas.urls[0]

            async def run_cells(results: dict[str, dict[str, Any]], name: str, url: str) -> None:
                results[name] = {}
                for c, stream, fresh in cells:
                    cell = await measure_cell(
                        url, concurrency=c, stream=stream, fresh=fresh, duration_s=duration_s
                    )
                    results[name][_key(c, stream, fresh)] = cell
                    say(
                        f"  {name:<28} {_key(c, stream, fresh):<18} {cell['req_per_s']:8.0f} req/s "
                        f"p50 {cell['p50_ms'] or 0:7.2f} ms  p99 {cell['p99_ms'] or 0:7.2f} ms"
                    )

            present: list[str] = []
            for t in targets:
                spec = PEERS[t]
                if find_binary(spec.binary) is None:
                    skipped[spec.name] = f"{spec.binary} not installed (pip install 'kvroute[peers]')"
                    say(f"skip {spec.name}: {skipped[spec.name]}")
                else:
                    present.append(t)
            for r in range(rounds):
                results: dict[str, dict[str, Any]] = {}
                if rounds > 1:
                    say(f"round {r + 1} of {rounds}")
                say("direct to the replica")
                await run_cells(results, "direct", replica)
                k = r % len(present) if present else 0
                for t in present[k:] + present[:k]:
                    spec = PEERS[t]
                    say(spec.name)
                    async with running_router(spec, replicas.urls, log_dir=log_dir) as router:
                        await run_cells(results, spec.name, router.url)
                per_round.append(results)
    if rounds == 1:
        doc = _summarise(per_round[0], skipped, duration_s)
    else:
        doc = _summarise_rounds(per_round, skipped, duration_s)
    doc["fleet"] = fleet
    return doc


def _summarise(results: dict[str, dict[str, Any]], skipped: dict[str, str], duration_s: float) -> dict[str, Any]:
    direct = results.get("direct", {})
    sglang = next((v for k, v in results.items() if k.startswith("sglang-router")), None)
    floor = results.get(PEERS["python-floor"].name)
    added: dict[str, dict[str, Any]] = {}
    for name, cells in results.items():
        if name == "direct":
            continue
        added[name] = {}
        for key, cell in cells.items():
            d = direct.get(key)
            if d is None:
                continue
            entry: dict[str, Any] = {
                "added_p50_ms": _diff(cell["p50_ms"], d["p50_ms"]),
                "added_p99_ms": _diff(cell["p99_ms"], d["p99_ms"]),
                "throughput_ratio_vs_direct": _ratio(cell["req_per_s"], d["req_per_s"]),
            }
            if sglang is not None and key in sglang:
                entry["throughput_ratio_vs_sglang_router"] = _ratio(cell["req_per_s"], sglang[key]["req_per_s"])
            if floor is not None and key in floor and cells is not floor:
                # what this router adds on top of the bare Python proxy of the same run
                entry["added_over_python_floor_p50_ms"] = _diff(cell["p50_ms"], floor[key]["p50_ms"])
            added[name][key] = entry
    return {
        "bench": "overhead",
        "duration_s_per_cell": duration_s,
        "note": "client, router and one emulated replica (near-zero modelled time) share this machine",
        "cells": results,
        "added": added,
        "skipped": skipped,
    }


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _summarise_rounds(
    per_round: Sequence[dict[str, dict[str, Any]]], skipped: dict[str, str], duration_s: float
) -> dict[str, Any]:
    """Several rounds of the same targets and cells in one document.

    ``cells``: per target and cell the median over rounds of req/s and the latency quantiles, the
    summed requests and errors. ``added``: each round's figures against that round's own direct
    cells (and floor, and sglang-router), then their median, with ``added_p50_ms_min`` / ``_max``
    over the rounds. ``paired``: for each kvroute target against each other router, on how many
    rounds its added p50 was the lower one, per cell. ``per_round``: every round's cells and added."""
    rounds = [_summarise(results, skipped, duration_s) for results in per_round]
    names = list(rounds[0]["cells"])
    cells: dict[str, dict[str, Any]] = {}
    added: dict[str, dict[str, Any]] = {}
    for name in names:
        cells[name] = {}
        for key in rounds[0]["cells"][name]:
            these = [rd["cells"][name][key] for rd in rounds if key in rd["cells"].get(name, {})]
            cell: dict[str, Any] = {
                k: these[0][k] for k in ("concurrency", "stream", "fresh_connections")
            }
            cell["requests"] = sum(c["requests"] for c in these)
            cell["errors"] = sum(c["errors"] for c in these)
            for field in ("req_per_s", "p50_ms", "p99_ms", "p999_ms", "max_ms"):
                cell[field] = _median([c[field] for c in these])
            cell["rounds"] = len(these)
            cells[name][key] = cell
        if name == "direct":
            continue
        added[name] = {}
        for key in rounds[0]["added"].get(name, {}):
            these = [rd["added"][name][key] for rd in rounds if key in rd["added"].get(name, {})]
            entry: dict[str, Any] = {f: _median([e.get(f) for e in these]) for f in these[0]}
            p50s = [e["added_p50_ms"] for e in these if e["added_p50_ms"] is not None]
            entry["added_p50_ms_min"] = min(p50s) if p50s else None
            entry["added_p50_ms_max"] = max(p50s) if p50s else None
            added[name][key] = entry
    paired: dict[str, dict[str, dict[str, int]]] = {}
    floor = PEERS["python-floor"].name
    for mine in (n for n in names if n.startswith("kvroute")):
        paired[mine] = {}
        for other in (n for n in names if n not in ("direct", mine, floor)):
            wins: dict[str, int] = {}
            for key in rounds[0]["added"].get(mine, {}):
                pairs = [
                    (rd["added"][mine][key]["added_p50_ms"], rd["added"][other][key]["added_p50_ms"])
                    for rd in rounds
                    if key in rd["added"].get(mine, {}) and key in rd["added"].get(other, {})
                ]
                wins[key] = sum(1 for a, b in pairs if a is not None and b is not None and a < b)
            paired[mine][other] = wins
    return {
        "bench": "overhead",
        "duration_s_per_cell": duration_s,
        "rounds": len(rounds),
        "note": (
            "client, router and one emulated replica (near-zero modelled time) share this machine; "
            "figures are medians over rounds, each round against its own direct cells"
        ),
        "cells": cells,
        "added": added,
        "paired": paired,
        "per_round": [{"cells": rd["cells"], "added": rd["added"]} for rd in rounds],
        "skipped": skipped,
    }


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def print_table(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rounds = doc.get("rounds", 1)
    title = "router overhead (vs direct to one emulated replica)"
    if rounds > 1:
        title += f": medians of {rounds} rounds"
    table = Table(title=title)
    cols = ["target", "cell", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms", "thr/direct", "+p50 over floor"]
    if rounds > 1:
        cols.insert(6, "+p50 min-max")
    for col in cols:
        table.add_column(col, justify="right" if col not in ("target", "cell") else "left")
    for name, cells in doc["cells"].items():
        for key, cell in cells.items():
            a = doc["added"].get(name, {}).get(key, {})
            row = [
                name,
                key,
                f"{cell['req_per_s']:.0f}",
                _fmt(cell["p50_ms"]),
                _fmt(cell["p99_ms"]),
                _fmt(a.get("added_p50_ms")),
                _fmt(a.get("added_p99_ms")),
                _fmt(a.get("throughput_ratio_vs_direct")),
                _fmt(a.get("added_over_python_floor_p50_ms")),
            ]
            if rounds > 1:
                lo, hi = a.get("added_p50_ms_min"), a.get("added_p50_ms_max")
                row.insert(6, "-" if lo is None or hi is None else f"{lo:.2f}-{hi:.2f}")
            table.add_row(*row)
    console = Console(stderr=True, width=180)
    console.print(table)
    for mine, others in doc.get("paired", {}).items():
        for other, wins in others.items():
            text = ", ".join(f"{k} {n}/{rounds}" for k, n in wins.items())
            console.print(f"rounds where {mine} added less p50 than {other}: {text}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=2.5, help="seconds per cell (after 0.3 s warm-up)")
    p.add_argument("--concurrency", type=int, action="append", help="repeat; default 1 and 32")
    p.add_argument(
        "--targets", default=",".join(OVERHEAD_TARGETS), help=f"comma list from {sorted(PEERS)}"
    )
    p.add_argument(
        "--fleet",
        type=int,
        default=1,
        help="replicas behind each router (one emulator process); direct talks to the first",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole sequence this many times (targets rotated, each round against its own "
        "direct cells) and report medians: for a machine whose speed drifts",
    )
    p.add_argument("--json", type=Path, help="write the JSON here (also printed to stdout)")
    ns = p.parse_args(argv)
    if ns.fleet < 1:
        p.error("--fleet: at least 1")
    if ns.rounds < 1:
        p.error("--rounds: at least 1")
    targets = [t for t in ns.targets.split(",") if t]
    unknown = [t for t in targets if t not in PEERS]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {sorted(PEERS)}")
    doc = asyncio.run(
        run_overhead(
            targets=targets,
            concurrencies=ns.concurrency or (1, 32),
            duration_s=ns.duration,
            fleet=ns.fleet,
            rounds=ns.rounds,
        )
    )
    print_table(doc)
    emit_json(doc, ns.json)
    return 0
