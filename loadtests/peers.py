"""Start and stop the routers under test as subprocesses: kvroute, sglang-router, vllm-router.

Every router runs in its own process on 127.0.0.1 with its own free port (and its own Prometheus port
for the peers: both default to 29000 and panic on a clash). Readiness is checked the way each router
needs: sglang binds at once and registers workers in the background,
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
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from loadtests.procs import RunningProcess, free_port, read_urls, start_process, stop_process
from loadtests.redis_server import RedisServer, RedisUnavailable

__all__ = [
    "PEERS",
    "PeerSpec",
    "emulated_fleet",
    "find_binary",
    "peer_argv",
    "running_redis",
    "running_router",
    "with_engine_dp",
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
    # on data-parallel engines (bench peers --engine-dp N): each engine one replica, its rank picked
    # at forwarding (the session's own, else the least busy), instead of every rank a replica
    "kvroute-engines": PeerSpec(
        "kvroute kv_aware (engines as replicas)", "kvroute", "kv_aware", "kvroute", args=("--replica-dp-ranks", "1"),
        note="each engine one replica; the rank picked at forwarding",
    ),
    # with --kv-events: the same policy with the engines' events ignored (residency by estimate)
    "kvroute-estimate": PeerSpec(
        "kvroute kv_aware (estimate)", "kvroute", "kv_aware", "kvroute", args=("--set", "kv_events.mode=off"),
        note="KV events ignored: residency by estimate",
    ),
    # sglang-router delays every SSE response on a reused keep-alive connection by ~40 ms: drive it
    # with fresh connections so the comparison does not flatter us.
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
        note="uvloop + httptools server + kvroute's upstream client, one replica, no logic",
    ),
}


def with_engine_dp(spec: PeerSpec, dp: int) -> PeerSpec:
    """``spec`` in front of engines of ``dp`` data-parallel ranks, in that router's own data-parallel
    mode. kvroute's is ``--replica-dp-ranks``: every rank a replica of its own. sglang-router's
    ``--dp-aware`` makes each rank a worker of its own and names it in the body (``data_parallel_rank``);
    with ``--api-key`` it would also demand that key of clients (401), so none is given.
    vllm-router's ``--intra-node-data-parallel-size`` names the rank in a header and wants an API key
    for the workers, which SGLang without ``--api-key`` ignores."""
    if dp == 1 or spec.kind not in ("kvroute", "sglang", "vllm"):
        return spec
    if spec.kind == "kvroute":
        if "--replica-dp-ranks" in spec.args:
            return spec
        args: tuple[str, ...] = ("--replica-dp-ranks", str(dp))
    elif spec.kind == "sglang":
        args = ("--dp-aware",)
    else:
        args = ("--intra-node-data-parallel-size", str(dp), "--api-key", "unused-by-sglang")
    note = f"{spec.note}; " if spec.note else ""
    return replace(spec, args=spec.args + args, note=f"{note}its own data-parallel mode ({' '.join(args[:2])})")


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
            "--worker-urls", *worker_urls, *spec.args, *extra,
        ]
        return argv
    if spec.kind == "vllm":
        return [
            binary, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", prom, "--log-level", "warning",
            "--policy", spec.policy, "--worker-startup-check-interval", "1",
            "--worker-urls", *worker_urls, *spec.args, *extra,
        ]
    raise ValueError(f"unknown router kind {spec.kind!r}")


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
async def running_redis(*, log_dir: Path, timeout_s: float = 20.0) -> AsyncIterator[RedisServer]:
    """A private ``redis-server`` on a free port (no persistence), for multi-gateway runs."""
    server = RedisServer(workdir=log_dir)
    try:
        await asyncio.to_thread(server.start, timeout_s)
    except RedisUnavailable as exc:
        raise FileNotFoundError(f"redis-server (needed for --gateways > 1): {exc}") from exc
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


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
