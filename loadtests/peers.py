"""Start and stop the routers under test as subprocesses: kvroute, sglang-router, vllm-router.

Every router runs in its own process on 127.0.0.1 with its own free port (and its own Prometheus port
for the peers: both default to 29000 and panic on a clash, ``reference/peers.md`` §6). Readiness is
checked the way each router needs (§6.2): sglang binds at once and registers workers in the background,
so ``/readiness`` must report all workers healthy; vllm-router binds only after a worker is healthy;
kvroute's ``/ready`` turns 200 once a replica is ACTIVE. Processes are stopped by the PID we recorded
(SIGTERM, then SIGKILL after a grace period), never by name.

The emulated fleet also runs as a subprocess (``kvroute emulate``), so the load driver's event loop,
the router and the replicas do not share one Python interpreter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

__all__ = [
    "PEERS",
    "PeerSpec",
    "RunningProcess",
    "emulated_fleet",
    "find_binary",
    "free_port",
    "peer_argv",
    "read_urls",
    "running_redis",
    "running_router",
    "start_process",
    "stop_process",
]


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One router configuration to benchmark."""

    name: str  # label in tables, e.g. "sglang-router cache_aware"
    kind: str  # "kvroute" | "sglang" | "vllm" | "floor"
    policy: str
    binary: str  # console script name ("kvroute", "smg", "vllm-router"; "python" for the floor)
    fresh_connections: bool = False  # drive it with a new TCP connection per request
    note: str = ""
    args: tuple[str, ...] = ()  # extra arguments of its command line (kvroute: `kvroute serve` flags)


PEERS: dict[str, PeerSpec] = {
    "kvroute": PeerSpec("kvroute kv_aware", "kvroute", "kv_aware", "kvroute"),
    "kvroute-hash": PeerSpec("kvroute hash", "kvroute", "hash", "kvroute"),
    # the gateway as it served the inference routes before the raw data plane (docs/BENCHMARKS.md)
    "kvroute-aiohttp": PeerSpec(
        "kvroute kv_aware (aiohttp server)", "kvroute", "kv_aware", "kvroute",
        note="downstream.server: aiohttp", args=("--downstream-server", "aiohttp"),
    ),
    # sglang-router delays every SSE response on a reused keep-alive connection by ~40 ms
    # (peers.md §3.8): drive it with fresh connections so the comparison does not flatter us.
    "sglang-cache_aware": PeerSpec(
        "sglang-router cache_aware", "sglang", "cache_aware", "smg", fresh_connections=True,
        note="fresh connection per request (keep-alive SSE adds ~40 ms on sglang-router)",
    ),
    "sglang-manual": PeerSpec(
        "sglang-router manual", "sglang", "manual", "smg", fresh_connections=True,
        note="sticky on X-SMG-Routing-Key; fresh connection per request",
    ),
    "vllm-consistent_hash": PeerSpec(
        "vllm-router consistent_hash", "vllm", "consistent_hash", "vllm-router", note="sticky on x-session-id"
    ),
    "vllm-sticky_least_loaded": PeerSpec(
        "vllm-router sticky_least_loaded", "vllm", "sticky_least_loaded", "vllm-router",
        note="sticky on x-session-id, new sessions to the least loaded",
    ),
    # not a router: the floor of any Python proxy here (loadtests/floor_proxy.py), for `bench overhead`
    "python-floor": PeerSpec(
        "python floor (no routing)", "floor", "none", "python",
        note="uvloop + httptools server + kvroute's raw upstream client, one replica, no logic",
    ),
}


def free_port() -> int:
    """A port the OS considers free right now (a tiny race remains; every router gets its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_binary(name: str) -> str | None:
    """The console script next to this interpreter (the venv) first, then PATH."""
    local = Path(sys.executable).parent / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def peer_argv(
    spec: PeerSpec, binary: str, port: int, worker_urls: Sequence[str], extra: Sequence[str] = ()
) -> list[str]:
    """The command line that starts ``spec`` on ``port`` in front of ``worker_urls`` (+ ``extra``)."""
    if spec.kind == "kvroute":
        argv = [binary, "serve", "--host", "127.0.0.1", "--port", str(port), "--policy", spec.policy]
        for u in worker_urls:
            argv += ["--replica", u]
        return argv + list(spec.args) + list(extra)
    if spec.kind == "floor":
        return [binary, "-m", "loadtests.floor_proxy", "--port", str(port), "--replica", worker_urls[0], *extra]
    prom = str(free_port())
    if spec.kind == "sglang":
        argv = [
            binary, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", prom, "--log-level", "warn",
            "--policy", spec.policy, "--shutdown-grace-period-secs", "2",
            "--worker-urls", *worker_urls, *extra,
        ]
        return argv
    if spec.kind == "vllm":
        return [
            binary, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", prom, "--log-level", "warning",
            "--policy", spec.policy, "--worker-startup-check-interval", "1",
            "--worker-urls", *worker_urls, *extra,
        ]
    raise ValueError(f"unknown router kind {spec.kind!r}")


@dataclass(slots=True)
class RunningProcess:
    name: str
    proc: asyncio.subprocess.Process
    log_path: Path
    url: str = ""
    urls: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


async def start_process(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path,
    pipe_stdout: bool = False,
    env: Mapping[str, str] | None = None,
) -> RunningProcess:
    """``argv`` in its own process group, output to ``log_dir``; ``env`` is added to ours."""
    log_path = log_dir / f"{name.replace(' ', '_').replace('/', '_')}.log"
    log = log_path.open("wb")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=None if env is None else {**os.environ, **env},
            stdout=asyncio.subprocess.PIPE if pipe_stdout else log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group: we stop exactly what we started
        )
    finally:
        log.close()
    return RunningProcess(name=name, proc=proc, log_path=log_path)


async def stop_process(p: RunningProcess, grace_s: float = 10.0) -> None:
    """SIGTERM the process group we started, SIGKILL it after ``grace_s``."""
    if p.proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(p.proc.wait(), timeout=grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        await p.proc.wait()


async def _wait_ready(
    p: RunningProcess, check: Callable[[aiohttp.ClientSession], Awaitable[bool]], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
        while True:
            if p.proc.returncode is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                if await check(http):
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} not ready after {timeout_s:.0f}s:\n{p.log_tail()}")
            await asyncio.sleep(0.2)


def _readiness_check(url: str, n_workers: int, kind: str) -> Callable[[aiohttp.ClientSession], Awaitable[bool]]:
    async def check(http: aiohttp.ClientSession) -> bool:
        if kind in ("kvroute", "floor"):
            async with http.get(f"{url}/ready") as r:
                return r.status == 200
        async with http.get(f"{url}/readiness") as r:
            if r.status != 200:
                return False
            doc = await r.json(content_type=None)
            return int(doc.get("healthy_workers", 0)) >= n_workers

    return check


@contextlib.asynccontextmanager
async def running_router(
    spec: PeerSpec,
    worker_urls: Sequence[str],
    *,
    log_dir: Path,
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[RunningProcess]:
    """Run ``spec`` in front of ``worker_urls`` until the block exits (``env``: added to ours).
    Raises FileNotFoundError if its binary is missing (callers skip the peer with a message)."""
    binary = find_binary(spec.binary)
    if binary is None:
        raise FileNotFoundError(f"{spec.binary} not found (pip install 'kvroute[peers]')")
    port = free_port()
    argv = peer_argv(spec, binary, port, worker_urls, extra_args)
    p = await start_process(spec.name, argv, log_dir=log_dir, env=env)
    p.url = f"http://127.0.0.1:{port}"
    try:
        await _wait_ready(p, _readiness_check(p.url, len(worker_urls), spec.kind), timeout_s)
        yield p
    finally:
        await stop_process(p)


@contextlib.asynccontextmanager
async def running_redis(*, log_dir: Path, timeout_s: float = 20.0) -> AsyncIterator[RunningProcess]:
    """A private ``redis-server`` on a free port (no persistence), for multi-gateway runs."""
    binary = find_binary("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server not found (needed for --gateways > 1)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(log_dir)]
    p = await start_process(f"redis-{port}", argv, log_dir=log_dir)
    p.url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"PING\r\n")
                await writer.drain()
                pong = await asyncio.wait_for(reader.readline(), timeout=2.0)
                writer.close()
                await writer.wait_closed()
                if pong.startswith(b"+PONG"):
                    break
            except OSError:
                pass
            if p.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start:\n{p.log_tail()}")
            await asyncio.sleep(0.1)
        yield p
    finally:
        await stop_process(p)


async def read_urls(p: RunningProcess, n: int, timeout_s: float) -> None:
    """Fill ``p.urls`` from the ``http...`` lines a child started with ``pipe_stdout`` prints, one
    per server, once each listens (``kvroute emulate``, ``bench probes``' static replicas)."""
    assert p.proc.stdout is not None
    while len(p.urls) < n:
        line = await asyncio.wait_for(p.proc.stdout.readline(), timeout=timeout_s)
        if not line:
            raise RuntimeError(f"{p.name} exited ({p.proc.returncode}):\n{p.log_tail()}")
        text = line.decode().strip()
        if text.startswith("http"):
            p.urls.append(text)
    p.url = p.urls[0]


@contextlib.asynccontextmanager
async def emulated_fleet(
    n: int, emulator_args: Sequence[str] = (), *, log_dir: Path | None = None, timeout_s: float = 60.0
) -> AsyncIterator[RunningProcess]:
    """``kvroute emulate --replicas n`` in a subprocess; yields once every replica answers /health."""
    own_dir = None
    if log_dir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="kvroute-fleet-")
        log_dir = Path(own_dir.name)
    binary = find_binary("kvroute") or "kvroute"
    argv = [binary, "emulate", "--replicas", str(n), "--host", "127.0.0.1", "--base-port", "0", *emulator_args]
    p = await start_process("emulators", argv, log_dir=log_dir, pipe_stdout=True)
    try:
        await read_urls(p, n, timeout_s)
    except BaseException:
        await stop_process(p)
        if own_dir is not None:
            own_dir.cleanup()
        raise

    async def all_healthy(http: aiohttp.ClientSession) -> bool:
        for u in p.urls:
            async with http.get(f"{u}/health") as r:
                if r.status != 200:
                    return False
        return True

    try:
        await _wait_ready(p, all_healthy, timeout_s)
        yield p
    finally:
        await stop_process(p)
        if own_dir is not None:
            own_dir.cleanup()


# ---- kvroute bench peers -------------------------------------------------------------------------

BENCH_TARGETS: tuple[str, ...] = (
    "kvroute",
    "sglang-cache_aware",
    "sglang-manual",
    "vllm-consistent_hash",
    "vllm-sticky_least_loaded",
)


async def run_peers_bench(
    targets: Sequence[str], scenario: object, *, out_dir: Path, say: Callable[[str], None]
) -> dict[str, object]:
    """Each target on a fresh emulated fleet, the identical workload; returns the JSON document."""
    from loadtests.demo import DemoScenario, run_policy
    from loadtests.report import plot_load, plot_ttft_cdf

    assert isinstance(scenario, DemoScenario)
    sessions = scenario.workload()
    results: dict[str, dict[str, object]] = {}
    skipped: dict[str, str] = {}
    loads: dict[str, list[tuple[float, tuple[int, ...]]]] = {}
    ttfts: dict[str, list[float]] = {}
    warm = scenario.duration_s * scenario.warmup_frac / scenario.time_scale
    with tempfile.TemporaryDirectory(prefix="kvroute-peers-") as tmp:
        for t in targets:
            spec = PEERS[t]
            if find_binary(spec.binary) is None:
                skipped[spec.name] = f"{spec.binary} not installed (pip install 'kvroute[peers]')"
                say(f"skip {spec.name}: {skipped[spec.name]}")
                continue
            say(f"running {spec.name} ({scenario.duration_s:.0f} s){'; ' + spec.note if spec.note else ''}")
            try:
                res = await run_policy(spec, scenario, sessions, log_dir=Path(tmp), live=False)
            except RuntimeError as exc:  # a router that failed to start: report, go on with the rest
                skipped[spec.name] = f"failed to start: {str(exc).splitlines()[0]}"
                say(f"skip {spec.name}: {skipped[spec.name]}")
                continue
            m = dict(res.measures)
            m["router"] = spec.kind
            m["policy"] = spec.policy
            m["note"] = spec.note
            results[spec.name] = m
            loads[spec.name] = [s for s in res.load_samples if s[0] >= warm]
            ttfts[spec.name] = [o.ttft_s for o in res.outcomes if o.ok and o.ttft_s is not None and o.t_start >= warm]
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {
        "load": str(plot_load(loads, out_dir / "peers_load.png", title=f"{scenario.replicas} emulated replicas")),
        "ttft_cdf": str(plot_ttft_cdf(ttfts, out_dir / "peers_ttft_cdf.png")),
    }
    return {"bench": "peers", "results": results, "skipped": skipped, "plots": plots}


# measures compared seed by seed: (key, label, higher is better)
_PAIRED: tuple[tuple[str, str, bool], ...] = (
    ("chr", "CHR", True),
    ("routing_loss", "routing loss", False),
    ("ttft_p50_s", "TTFT p50 (s)", False),
    ("ttft_p99_s", "TTFT p99 (s)", False),
    ("dispersion", "dispersion", False),
    ("dispersion_floor", "dispersion floor", False),
    ("p_load_ge12", "P(load>=12)", False),
    ("e2e_p99_s", "E2E p99 (s)", False),
    ("requests", "requests", True),
)


def summarise_seeds(per_seed: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """Across seeds: each router's mean / min / max per measure, and for every other router how many
    seeds kvroute did better on (paired: same seed, same workload), per measure."""
    routers: list[str] = []
    for results in per_seed.values():
        routers += [r for r in results if r not in routers]
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for r in routers:
        stats[r] = {}
        for key, _, _ in _PAIRED:
            xs = [float(res[r][key]) for res in per_seed.values() if r in res and res[r].get(key) is not None]
            if xs:
                stats[r][key] = {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    ours = next((r for r in routers if r.startswith("kvroute")), None)
    wins: dict[str, dict[str, str]] = {}
    if ours is not None:
        for r in routers:
            if r == ours:
                continue
            wins[r] = {}
            for key, _, higher in _PAIRED:
                pairs = [
                    (float(res[ours][key]), float(res[r][key]))
                    for res in per_seed.values()
                    if ours in res and r in res and res[ours].get(key) is not None and res[r].get(key) is not None
                ]
                better = sum(1 for a, b in pairs if (a > b if higher else a < b))
                wins[r][key] = f"{better}/{len(pairs)}"
    return {"seeds": sorted(per_seed), "stats": stats, "kvroute": ours, "kvroute_better_on_seeds": wins}


def seeds_table(summary: Mapping[str, Any]) -> Any:
    """A rich ``Table``: mean [min-max] per router and measure, and kvroute's paired wins."""
    from rich.table import Table

    stats: Mapping[str, Mapping[str, Mapping[str, float]]] = summary["stats"]
    wins: Mapping[str, Mapping[str, str]] = summary["kvroute_better_on_seeds"]
    table = Table(title=f"mean [min-max] over seeds {summary['seeds']}; 'kvroute better': seeds won, paired")
    table.add_column("measure")
    for r in stats:
        table.add_column(r, justify="right")
    for r in wins:
        table.add_column(f"kvroute better than {r}", justify="right")
    for key, label, _ in _PAIRED:
        fmt = "{:.0f}" if key == "requests" else "{:.4f}" if key == "p_load_ge12" else "{:.3f}"
        cells = []
        for r in stats:
            st = stats[r].get(key)
            cells.append("-" if st is None else f"{fmt.format(st['mean'])} [{fmt.format(st['min'])}-{fmt.format(st['max'])}]")
        table.add_row(label, *cells, *(wins[r].get(key, "-") for r in wins))
    return table


def bench_peers_main(argv: list[str]) -> int:
    import argparse
    import json
    from dataclasses import asdict

    from rich.console import Console

    from loadtests.demo import DemoScenario
    from loadtests.report import comparison_table

    d = DemoScenario()
    p = argparse.ArgumentParser(
        prog="kvroute bench peers",
        description="kvroute and the peer routers one after another on the identical workload and fleet",
    )
    routers = sorted(k for k, spec in PEERS.items() if spec.kind != "floor")  # the floor is one replica
    p.add_argument("--targets", default=",".join(BENCH_TARGETS), help=f"comma list from {routers}")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--duration", type=float, default=d.duration_s, help="wall seconds of load per router")
    p.add_argument("--sessions", type=int, default=d.sessions)
    p.add_argument("--time-scale", type=float, default=d.time_scale)
    p.add_argument("--token-unit", type=int, default=d.token_unit)
    p.add_argument("--profile", default=d.profile)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--seeds",
        help="comma list: one run per seed (the routers' order alternates from seed to seed), "
        "OUT/seed-S/ per seed, and a mean [min-max] table with kvroute's paired wins",
    )
    p.add_argument("--hicache", action="store_true", help="give the replicas their HiCache host tier (2x HBM)")
    p.add_argument("--workload", choices=["synthetic", "weka"], default="synthetic")
    p.add_argument("--trace", help="WEKA requests .jsonl (default: the copy in the shared traces)")
    p.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a kvroute policy parameter (repeatable, passed to kvroute serve), e.g. thicc_threshold=4",
    )
    p.add_argument("--out", type=Path, default=Path("out/peers"), help="directory for plots")
    p.add_argument("--json", type=Path, help="write the JSON here (default OUT/peers.json)")
    ns = p.parse_args(argv)
    targets = [t for t in ns.targets.split(",") if t]
    unknown = [t for t in targets if t not in routers]
    if unknown:
        p.error(f"unknown targets {unknown}; choose from {routers}")
    if ns.seeds is not None:
        try:
            seeds = [int(x) for x in ns.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds: a comma list of integers, not {ns.seeds!r}")
        if not seeds or len(set(seeds)) != len(seeds):
            p.error("--seeds: give at least one seed, each once")
        return _bench_peers_seeds(ns, targets, seeds)
    scenario = _scenario(ns, ns.seed)
    console = Console(stderr=True, width=160)
    doc = asyncio.run(run_peers_bench(targets, scenario, out_dir=ns.out, say=console.print))
    doc["scenario"] = asdict(scenario)
    results = doc["results"]
    assert isinstance(results, dict)
    if results:
        console.print(comparison_table(results, title="routers side by side (same workload, fresh fleet each)"))
    path = ns.json or ns.out / "peers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    console.print(f"wrote {path} and plots in {ns.out}")
    print(json.dumps(doc, indent=2))
    return 0


def _scenario(ns: Any, seed: int) -> Any:
    """The demo scenario that ``bench peers``' flags describe, with ``seed``."""
    from loadtests.demo import demo_scenario

    return demo_scenario(
        replicas=ns.replicas, duration_s=ns.duration, sessions=ns.sessions, time_scale=ns.time_scale,
        token_unit=ns.token_unit, profile=ns.profile, seed=seed, host_tier=ns.hicache,
        workload_kind=ns.workload, trace=ns.trace, policy_params=tuple(ns.policy_param),
    )


def _bench_peers_seeds(ns: Any, targets: Sequence[str], seeds: Sequence[int]) -> int:
    """``bench peers --seeds``: the single-seed bench once per seed, then the summary."""
    import json
    from dataclasses import asdict

    from rich.console import Console

    from loadtests.report import comparison_table

    console = Console(stderr=True, width=200)
    per_seed: dict[int, dict[str, Any]] = {}
    docs: dict[str, Any] = {}
    for i, seed in enumerate(seeds):
        scenario = _scenario(ns, seed)
        order = list(targets) if i % 2 == 0 else list(reversed(targets))  # drift falls on every router alike
        console.print(f"seed {seed} ({i + 1}/{len(seeds)}): {', '.join(order)}")
        out = ns.out / f"seed-{seed}"
        doc = asyncio.run(run_peers_bench(order, scenario, out_dir=out, say=console.print))
        doc["scenario"] = asdict(scenario)
        (out / "peers.json").write_text(json.dumps(doc, indent=2) + "\n")
        results = doc["results"]
        assert isinstance(results, dict)
        if results:
            console.print(comparison_table(results, title=f"seed {seed}"))
        per_seed[seed] = results
        docs[str(seed)] = doc
    summary = summarise_seeds(per_seed)
    console.print(seeds_table(summary))
    path = ns.json or ns.out / "peers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {"bench": "peers", "seeds": list(seeds), "summary": summary, "per_seed": docs}
    path.write_text(json.dumps(full, indent=2) + "\n")
    console.print(f"wrote {path} (per seed: {ns.out}/seed-S/)")
    print(json.dumps({"bench": "peers", "seeds": list(seeds), "summary": summary}, indent=2))
    return 0
