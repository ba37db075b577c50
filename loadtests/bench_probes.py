"""``kvroute bench probes``: what discovery's background probes cost the requests a gateway relays.

A gateway health-checks and scrapes every replica each interval (``health.*``, docs/CONFIG.md). With
many replicas, answers that arrive together are handled back to back on the gateway's one event
loop (~0.1 ms a ``/health``, ~0.5 ms a parsed ``/metrics``), and every request being relayed waits.
The emulator cannot show this: it serves all its replicas from one loop, which spaces their answers
out by itself. So this bench puts ``--replicas`` *static* replicas in one subprocess
(``python -m loadtests.bench_probes --serve N``: canned ``/health``, a canned emulator exposition on
``/metrics``, a canned SGLang ``/v1/loads``, a canned chat completion; each answer costs them next to
nothing), then, for each value
of ``health.spread`` in ``--spreads`` (alternating, ``--repeat`` times), starts ``kvroute serve`` in
front of all of them and measures c=1 latency for ``--duration`` seconds. Prints a table on stderr
and JSON on stdout (p50 / p99 / p99.9 / max, ms).

``--idle-cpu --gateways 1,2``: no traffic; for each count G, G gateways on one private Redis in front
of the same static replicas, started a little apart, and over ``--duration`` seconds each gateway's
own CPU per second (``/proc``, Linux) and the ``/metrics`` scrapes, ``/v1/loads`` reads and
``/health`` checks each replica answered per second (discovery rules 6 and 7: the gateways share one
scrape and one health check per replica per interval through the store; rule 4: the load is read
from ``/v1/loads``, ``/metrics`` only now and then).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from loadtests.bench import emit_json
from loadtests.overhead import measure_cell
from loadtests.peers import PEERS, running_redis, running_router
from loadtests.procs import read_urls, start_process, stop_process
from loadtests.soak import cpu_s

__all__ = ["cli_main", "run_idle_cpu_bench", "run_probes_bench"]

_CHAT = {
    "id": "static",
    "object": "chat.completion",
    "created": 1,
    "model": "default",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 16, "total_tokens": 56},
}


async def _serve_static(n: int) -> None:
    """The static replicas (``--serve N``): N aiohttp apps on free ports, all on this process's loop;
    prints each one's URL once it listens (``peers.read_urls``)."""
    import socket

    from aiohttp import web

    from replica.emulator.metrics import ReplicaMetrics
    from replica.emulator.timemodel import EngineLoad

    load = EngineLoad(
        running=2, queued=0, used_tokens=400_000, capacity_tokens=850_000, token_usage=0.47,
        evictable_tokens=300_000, host_used_tokens=0, host_total_tokens=0, cache_hit_rate=0.9,
        gen_throughput=500.0, spec_accept_length=2.0, waiting_tokens=0, decode_sum_seq_lens=200_000,
    )  # fmt: skip
    exposition = ReplicaMetrics("default", [lambda: load], hicache=False).render()
    rank = {"dp_rank": 0, "num_running_reqs": load.running, "num_waiting_reqs": load.queued,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": load.used_tokens,
            "max_total_num_tokens": load.capacity_tokens, "max_running_requests": 64,
            "token_usage": load.token_usage, "gen_throughput": load.gen_throughput,
            "cache_hit_rate": load.cache_hit_rate}  # fmt: skip
    loads_doc = json.dumps({"version": "0.5.23", "loads": [rank]}).encode()
    chat = json.dumps(_CHAT).encode()
    scrapes = [0, 0, 0]  # /metrics, /health and /v1/loads answered by all of them (``GET /_scrapes`` on any)

    async def health(_: web.Request) -> web.Response:
        scrapes[1] += 1
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        scrapes[0] += 1
        return web.Response(body=exposition, content_type="text/plain")

    async def loads(_: web.Request) -> web.Response:
        scrapes[2] += 1
        return web.Response(body=loads_doc, content_type="application/json")

    async def scrape_count(_: web.Request) -> web.Response:
        return web.json_response({"scrapes": scrapes[0], "health_checks": scrapes[1], "loads": scrapes[2]})

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=chat, content_type="application/json")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "default", "object": "model"}]})

    for _ in range(n):
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/v1/loads", loads)
        app.router.add_get("/_scrapes", scrape_count)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


@contextlib.asynccontextmanager
async def _static_replicas(n: int) -> AsyncIterator[tuple[list[str], Path]]:
    """``n`` static replicas in one subprocess (``--serve``): their URLs and a log directory."""
    with tempfile.TemporaryDirectory(prefix="kvroute-probes-") as tmp:
        log_dir = Path(tmp)
        argv = [sys.executable, "-m", "loadtests.bench_probes", "--serve", str(n)]
        static = await start_process("static-replicas", argv, log_dir=log_dir, pipe_stdout=True)
        try:
            await read_urls(static, n, timeout_s=max(30.0, n / 10))
            yield static.urls, log_dir
        finally:
            await stop_process(static)


async def run_probes_bench(
    *, replicas: int, spreads: Sequence[float], repeat: int, duration_s: float, log: Any = None
) -> dict[str, Any]:
    say = log or (lambda msg: print(msg, file=sys.stderr))
    runs: list[dict[str, Any]] = []
    async with _static_replicas(replicas) as (urls, log_dir):
        for r in range(repeat):
            for spread in spreads:
                env = {"KVROUTE_HEALTH__SPREAD": str(spread)}
                async with running_router(PEERS["kvroute"], urls, log_dir=log_dir, env=env) as gw:
                    cell = await measure_cell(
                        gw.url, concurrency=1, stream=False, fresh=False, duration_s=duration_s, warmup_s=1.0
                    )
                runs.append({"spread": spread, "run": r + 1, **cell})
                say(
                    f"  spread {spread:<4} run {r + 1}: {cell['requests']} requests, p50 {cell['p50_ms']:.2f} "
                    f"p99 {cell['p99_ms']:.2f} p99.9 {cell['p999_ms']:.2f} max {cell['max_ms']:.2f} ms"
                )
    return {"bench": "probes", "replicas": replicas, "duration_s": duration_s, "runs": runs}


async def run_idle_cpu_bench(
    *, replicas: int, gateways: Sequence[int], duration_s: float, warmup_s: float = 8.0, log: Any = None
) -> dict[str, Any]:
    import aiohttp

    say = log or (lambda msg: print(msg, file=sys.stderr))
    runs: list[dict[str, Any]] = []
    async with _static_replicas(replicas) as (urls, log_dir):

        async def probes(http: aiohttp.ClientSession) -> tuple[int, int, int]:
            async with http.get(urls[0] + "/_scrapes") as r:
                doc = await r.json()
                return int(doc["scrapes"]), int(doc["health_checks"]), int(doc["loads"])

        async with aiohttp.ClientSession() as http:
            for g in gateways:
                async with running_redis(log_dir=log_dir) as redis, contextlib.AsyncExitStack() as stack:
                    procs = []
                    for i in range(g):
                        env = {"KVROUTE_REDIS_URL": redis.url, "KVROUTE_GATEWAY_ID": f"bench-gw{i}"}
                        procs.append(await stack.enter_async_context(
                            running_router(PEERS["kvroute"], urls, log_dir=log_dir, env=env, timeout_s=120)))  # fmt: skip
                        await asyncio.sleep(0.37)  # started apart, as gateways are: their rounds at other phases
                    await asyncio.sleep(warmup_s)
                    c0, n0, t0 = [cpu_s(p.proc.pid) for p in procs], await probes(http), time.monotonic()
                    await asyncio.sleep(duration_s)
                    c1, n1, t1 = [cpu_s(p.proc.pid) for p in procs], await probes(http), time.monotonic()
                cpu = [round((b - a) / (t1 - t0), 3) for a, b in zip(c0, c1, strict=True)]
                scraped, checked, loaded = (
                    round((b - a) / (t1 - t0) / replicas, 3) for a, b in zip(n0, n1, strict=True)
                )
                runs.append({"gateways": g, "cpu_per_s": cpu, "cpu_per_s_total": round(sum(cpu), 3),
                             "scrapes_per_replica_per_s": scraped, "loads_per_replica_per_s": loaded,
                             "health_checks_per_replica_per_s": checked})  # fmt: skip
                say(f"  {g} gateway(s): CPU/s {cpu} (total {sum(cpu):.2f}), per replica per s: {scraped} /metrics "
                    f"scrapes, {loaded} /v1/loads reads, {checked} health checks")  # fmt: skip
    return {"bench": "probes-idle-cpu", "replicas": replicas, "duration_s": duration_s, "runs": runs}


def cli_main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        asyncio.run(_serve_static(int(argv[1])))
        return 0
    p = argparse.ArgumentParser(prog="kvroute bench probes", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=50)
    p.add_argument("--spreads", default="0,0.8", help="comma list of health.spread values")
    p.add_argument("--repeat", type=int, default=2, help="runs per spread value (alternating)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of c=1 load per run")
    p.add_argument("--json", type=Path, help="also write the JSON here")
    p.add_argument("--idle-cpu", action="store_true", help="no traffic: each gateway's CPU and the scrapes per replica")
    p.add_argument("--gateways", default="1,2", help="with --idle-cpu: comma list of gateway counts (one Redis)")
    p.add_argument("--warmup", type=float, default=8.0, help="with --idle-cpu: seconds before measuring")
    ns = p.parse_args(argv)
    if ns.idle_cpu:
        try:
            counts = [int(x) for x in ns.gateways.split(",") if x.strip()]
        except ValueError:
            p.error(f"--gateways: a comma list of integers, not {ns.gateways!r}")
        if ns.replicas < 1 or not counts or any(c < 1 for c in counts):
            p.error("--replicas and every --gateways count at least 1")
        if ns.duration <= 0 or ns.warmup < 0:
            p.error("--duration must be > 0 and --warmup >= 0")
        doc = asyncio.run(
            run_idle_cpu_bench(replicas=ns.replicas, gateways=counts, duration_s=ns.duration, warmup_s=ns.warmup)
        )
        return _emit(doc, ns.json)
    try:
        spreads = [float(x) for x in ns.spreads.split(",") if x.strip()]
    except ValueError:
        p.error(f"--spreads: a comma list of numbers, not {ns.spreads!r}")
    if ns.replicas < 1 or ns.repeat < 1 or not spreads or any(not 0 <= s <= 0.95 for s in spreads):
        p.error("--replicas and --repeat at least 1, --spreads within [0, 0.95]")
    doc = asyncio.run(
        run_probes_bench(replicas=ns.replicas, spreads=spreads, repeat=ns.repeat, duration_s=ns.duration)
    )
    return _emit(doc, ns.json)


def _emit(doc: dict[str, Any], path: Path | None) -> int:
    emit_json(doc, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
