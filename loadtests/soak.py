"""Connection-scale soak of ONE gateway: many idle connections + active streams, bounded; prints JSON.

``python -m loadtests.soak [--idle 10000] [--idle-streams 3000] [--active 1000] [--duration-s 15]``
(later ``kvroute bench soak``) starts, on 127.0.0.1:

- an upstream SSE server process (this module with ``--serve-upstream``): a minimal SGLang-shaped
  replica whose streams are either *active* (``max_tokens`` chunks, 5 ms apart, usage, ``[DONE]``),
  *idle* (one chunk, then an SSE comment every few seconds until the client leaves) or *big*
  (megabytes as fast as the socket takes them: the slow-reader case);
- one ``kvroute serve`` gateway process (memory store) in front of it;

and from this process (file limit raised with ``resource.setrlimit`` to the hard limit):

1. ``idle - idle_streams`` idle keep-alive connections (each answered one ``GET /health`` and stays
   open, as an agent's connection does between turns) and ``idle_streams`` open streams that are idle
   (first chunk received, then nothing). RSS of the gateway (``/proc/<pid>/status``) before and after
   gives memory per connection. Why not all 10,000 as open streams: each proxied stream costs the
   gateway two sockets and the container's hard file limit is printed in the JSON (20,000 here), so a
   single process cannot hold 10,000 proxied streams plus the active ones;
2. ``active`` concurrent closed-loop streams for ``duration_s`` on top: completed/errors, TTFT and e2e
   p50/p99;
3. a slow reader: one client asks for a big stream and reads nothing; the active streams' p99 with it
   vs without, and the gateway's RSS growth (backpressure bounds its buffers);
4. upstream pool bound: a second gateway with ``max_connections=--pool-limit`` gets ``--pool-burst``
   concurrent streams; the peak of its established upstream connections (``/proc/net/tcp``) must not
   exceed the limit, and every stream must complete.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.procs import Procs, read_line

__all__ = ["cli_main", "run_soak"]

PY = sys.executable


# ---- upstream (subprocess) ---------------------------------------------------------------------------


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _serve_upstream() -> None:
    from aiohttp import web

    async def inference(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        mode = body.get("soak", "active")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "tok "}}]}
        if mode == "idle":
            await resp.write(_sse(chunk))
            while True:  # until the client (the gateway) goes away: the handler is cancelled
                await asyncio.sleep(5.0)
                await resp.write(b": ping\n\n")
        if mode == "big":
            blob = _sse({**chunk, "choices": [{"index": 0, "delta": {"content": "x" * 60_000}}]})
            for _ in range(int(body.get("chunks", 500))):
                await resp.write(blob)
        else:
            for _ in range(int(body.get("max_tokens", 16))):
                await resp.write(_sse(chunk))
                await asyncio.sleep(0.005)
        n = int(body.get("max_tokens", 16))
        await resp.write(_sse({"id": "c", "object": "chat.completion.chunk", "choices": [],
                               "usage": {"prompt_tokens": 100, "completion_tokens": n, "total_tokens": 100 + n,
                                         "prompt_tokens_details": {"cached_tokens": 90}}}))  # fmt: skip
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(_r: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(text="sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:token_usage 0\n"
                                 "sglang:max_total_num_tokens 850000\n", content_type="text/plain")  # fmt: skip

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "soak"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", inference)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(f"http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


# ---- measurement helpers -------------------------------------------------------------------------------


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def established_to(port: int) -> int:
    """Established TCP connections on this host whose remote port is ``port`` (the clients of a server)."""
    n = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            next(f)
            for line in f:
                parts = line.split()
                if parts[3] == "01" and int(parts[2].rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))] * 1000, 2)


async def start_gateway(
    procs: Procs, upstream: str, max_connections: int, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    p = procs.start([PY, "-m", "router.cli", "serve", "--port", "0", "--replica", upstream,
                     "--set", f"max_connections={max_connections}", "--set", "health.health_interval_s=1",
                     "--set", "timeouts.first_byte_s=60", "--set", "timeouts.idle_read_s=120", *extra],
                    stderr_pipe=True)  # fmt: skip
    while True:
        line = await read_line(p.stderr)
        if "gateway listening on" in line:
            procs.drain(p)
            return p, int(line.rsplit(":", 1)[-1])
        if not line and p.poll() is not None:
            raise RuntimeError("gateway did not start")


def _request(port: int, body: dict[str, Any], sid: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Modal-Session-Id: {sid}\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data  # fmt: skip


async def _read_response_head(r: asyncio.StreamReader) -> int:
    head = await r.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1])


async def _read_chunked_until_done(r: asyncio.StreamReader) -> bytes:
    out = b""
    while True:
        size = int((await r.readline()).strip() or b"0", 16)
        if size == 0:
            await r.readline()
            return out
        out += await r.readexactly(size)
        await r.readexactly(2)


# ---- phases -------------------------------------------------------------------------------------------


@dataclass
class Conns:
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    failed: int = 0

    def close(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()


async def open_idle(port: int, n: int, *, stream: bool, conns: Conns, batch: int = 250) -> None:
    async def one(i: int) -> None:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            if stream:
                w.write(_request(port, {"model": "m", "messages": [{"role": "user", "content": "idle"}],
                                        "stream": True, "soak": "idle"}, f"idle-{i}"))  # fmt: skip
                await w.drain()
                status = await asyncio.wait_for(_read_response_head(r), 60)
                size = int((await asyncio.wait_for(r.readline(), 60)).strip(), 16)
                await r.readexactly(size + 2)  # the first event: the stream is open and now idle
            else:
                w.write(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                await w.drain()
                status = await asyncio.wait_for(_read_response_head(r), 60)
            if status != 200:
                raise RuntimeError(f"status {status}")
            conns.writers.append(w)
        except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            conns.failed += 1

    for start in range(0, n, batch):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + batch))))


@dataclass
class ActiveStats:
    completed: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"completed": self.completed, "errors": self.errors, "ttft_p50_ms": pct(self.ttft, 0.5),
                "ttft_p99_ms": pct(self.ttft, 0.99), "e2e_p50_ms": pct(self.e2e, 0.5), "e2e_p99_ms": pct(self.e2e, 0.99)}  # fmt: skip


async def run_active(port: int, n: int, duration_s: float, stats: ActiveStats, *, once: bool = False) -> None:
    """``n`` closed-loop streams on keep-alive connections for ``duration_s`` (or one request each)."""
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + duration_s

    async def client(i: int) -> None:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            stats.errors += 1
            return
        try:
            turn = 0
            while True:
                turn += 1
                t0 = loop.time()
                w.write(_request(port, {"model": "m", "messages": [{"role": "user", "content": f"t{turn}"}],
                                        "stream": True, "max_tokens": 16}, f"act-{i}"))  # fmt: skip
                await w.drain()
                status = await asyncio.wait_for(_read_response_head(r), 60)
                size = int((await asyncio.wait_for(r.readline(), 60)).strip(), 16)
                first = await r.readexactly(size + 2)
                stats.ttft.append(loop.time() - t0)
                rest = first + await asyncio.wait_for(_read_chunked_until_done(r), 60)
                if status == 200 and b"data: [DONE]" in rest and b'"error"' not in rest:
                    stats.completed += 1
                    stats.e2e.append(loop.time() - t0)
                else:
                    stats.errors += 1
                if once or loop.time() >= stop_at:
                    return
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
            stats.errors += 1
        finally:
            w.transport.abort()

    await asyncio.gather(*(client(i) for i in range(n)))


async def slow_reader(port: int) -> asyncio.StreamWriter:
    """Ask for a big stream (~30 MB) and never read it: a small receive buffer fills at once."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _r, w = await asyncio.open_connection(sock=sock)
    w.transport.pause_reading()  # type: ignore[attr-defined]
    w.write(_request(port, {"model": "m", "messages": [{"role": "user", "content": "big"}], "stream": True,
                            "soak": "big", "chunks": 500}, "slow-reader"))  # fmt: skip
    await w.drain()
    return w


async def run_soak(
    *, idle: int = 10_000, idle_streams: int = 3_000, active: int = 1_000, duration_s: float = 15.0,
    pool_limit: int = 32, pool_burst: int = 300, log: Any = None, gateway_args: Sequence[str] = (),
) -> dict[str, Any]:
    say = log or (lambda _m: None)
    fd_limit = raise_fd_limit()
    procs = Procs()
    out: dict[str, Any] = {"bench": "soak", "fd_limit": fd_limit, "idle_keepalive": idle - idle_streams,
                           "idle_streams": idle_streams, "active": active, "duration_s": duration_s}  # fmt: skip
    conns = Conns()
    try:
        up = procs.start([PY, "-m", "loadtests.soak", "--serve-upstream"])
        upstream = await read_line(up.stdout)
        procs.drain(up)
        up_port = int(upstream.rsplit(":", 1)[1])
        gw, port = await start_gateway(
            procs, upstream, max_connections=idle_streams + active + 256, extra=gateway_args
        )
        await asyncio.sleep(1.5)  # first health round: the upstream is ACTIVE
        warm = ActiveStats()
        await run_active(port, 50, 0.0, warm, once=True)
        rss0 = rss_kb(gw.pid)
        say(f"gateway RSS after warm-up {rss0} kB; opening {idle - idle_streams} idle keep-alive connections")
        t0 = time.monotonic()
        await open_idle(port, idle - idle_streams, stream=False, conns=conns)
        rss1 = rss_kb(gw.pid)
        say(f"opening {idle_streams} idle streams")
        await open_idle(port, idle_streams, stream=True, conns=conns)
        open_s = time.monotonic() - t0
        await asyncio.sleep(1.0)
        rss2 = rss_kb(gw.pid)
        kept = len(conns.writers)
        out["idle_open"] = {"held": kept, "failed": conns.failed, "open_s": round(open_s, 1)}
        out["rss_kb"] = {"warm": rss0, "with_keepalive": rss1, "with_idle_streams": rss2}
        ka = idle - idle_streams
        out["kb_per_idle_keepalive_conn"] = round((rss1 - rss0) / ka, 2) if ka else None
        out["kb_per_idle_stream"] = round((rss2 - rss1) / idle_streams, 2) if idle_streams else None
        out["kb_per_connection_all_idle"] = round((rss2 - rss0) / max(1, idle), 2)
        say(f"{kept} idle connections held; running {active} active streams for {duration_s}s")
        act = ActiveStats()
        t1, c1 = time.monotonic(), cpu_s(gw.pid)
        await run_active(port, active, duration_s, act)
        gw_cpu = cpu_s(gw.pid) - c1
        out["active_phase"] = {**act.summary(), "wall_s": round(time.monotonic() - t1, 1),
                               "gateway_cpu_s": round(gw_cpu, 2),
                               "gateway_cpu_ms_per_stream": round(1000 * gw_cpu / max(1, act.completed), 2),
                               "idle_still_open": sum(1 for w in conns.writers if not w.transport.is_closing())}  # fmt: skip
        out["rss_kb"]["after_active"] = rss_kb(gw.pid)
        conns.close()
        await asyncio.sleep(1.0)

        say("slow reader vs 100 active streams")
        base = ActiveStats()
        await run_active(port, 100, min(duration_s, 5.0), base)
        rss_before_slow = rss_kb(gw.pid)
        w = await slow_reader(port)
        await asyncio.sleep(1.0)
        with_slow = ActiveStats()
        await run_active(port, 100, min(duration_s, 5.0), with_slow)
        rss_with_slow = rss_kb(gw.pid)
        w.transport.abort()
        out["slow_reader"] = {"without": base.summary(), "with": with_slow.summary(),
                              "gateway_rss_growth_kb": rss_with_slow - rss_before_slow,
                              "stream_size_mb": round(500 * 60_000 / 1e6, 1)}  # fmt: skip

        say(f"upstream pool bound: max_connections={pool_limit}, {pool_burst} concurrent streams")
        gw2, port2 = await start_gateway(procs, upstream, max_connections=pool_limit, extra=gateway_args)
        await asyncio.sleep(1.5)
        peak = 0
        sampling = True

        async def sample() -> None:
            nonlocal peak
            while sampling:
                # clients of the upstream: only gateway 2 is talking to it now (gateway 1 is idle)
                peak = max(peak, established_to(up_port))
                await asyncio.sleep(0.02)

        gw.send_signal(signal.SIGTERM)  # gateway 1 off, so every upstream connection is gateway 2's
        gw.wait(15)
        sampler = asyncio.create_task(sample())
        burst = ActiveStats()
        await run_active(port2, pool_burst, 0.0, burst, once=True)
        sampling = False
        await sampler
        out["pool"] = {"max_connections": pool_limit, "burst": pool_burst, "peak_upstream_connections": peak,
                       **burst.summary()}  # fmt: skip
        out["ok"] = bool(
            conns.failed == 0 and act.errors == 0 and with_slow.errors == 0 and burst.errors == 0
            and burst.completed == pool_burst and peak <= pool_limit
        )
        del gw2
    finally:
        conns.close()
        procs.cleanup()
    return out


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--idle", type=int, default=10_000, help="idle connections in all (keep-alive + idle streams)")
    p.add_argument("--idle-streams", type=int, default=3_000, help="of which open, idle streams")
    p.add_argument("--active", type=int, default=1_000)
    p.add_argument("--duration-s", type=float, default=15.0)
    p.add_argument("--pool-limit", type=int, default=32)
    p.add_argument("--pool-burst", type=int, default=300)
    p.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help="extra `kvroute serve` argument of the soaked gateway (repeatable), e.g. --gateway-arg=--no-decision-headers",
    )
    a = p.parse_args(argv)
    if a.serve_upstream:
        raise_fd_limit()
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve_upstream())
        return 0
    if a.idle_streams > a.idle or a.active < 1 or a.duration_s <= 0 or a.duration_s > 600:
        print("kvroute bench soak: need idle-streams <= idle, active >= 1, 0 < duration-s <= 600", file=sys.stderr)
        return 2
    out = asyncio.run(run_soak(idle=a.idle, idle_streams=a.idle_streams, active=a.active, duration_s=a.duration_s,
                               pool_limit=a.pool_limit, pool_burst=a.pool_burst, gateway_args=a.gateway_arg,
                               log=lambda m: print(m, file=sys.stderr, flush=True)))  # fmt: skip
    print(json.dumps(out, indent=2))
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
