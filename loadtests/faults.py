"""Fault campaign: real processes under closed-loop streaming load, one fault at a time, outcomes counted.

``python -m loadtests.faults [--replicas 4] [--clients 16] [--phase-s 4] [--faults a,b,...]`` (later
``kvroute bench faults``) starts, all on 127.0.0.1:

- one ``kvroute emulate`` process per replica (so one can be SIGKILLed), small-test profile, fast clock;
- a real ``redis-server`` behind a :class:`loadtests.tcp_proxy.TcpProxy` (added latency, cuts);
- two ``kvroute serve`` gateways sharing that Redis (so one can be SIGKILLed while the other serves);

then runs closed-loop coding-agent-like sessions (growing history, SSE streams with usage) against the
gateways and applies each fault for one phase. Every request ends in exactly one bucket:

- ``completed``: 200 and the stream ended with ``data: [DONE]`` and no error event;
- ``clean_error``: the client was told: a non-2xx with a JSON error body, an SSE error event, or a
  transport error it saw (connection refused/reset by a killed process);
- ``lost``: anything silent: a 200 stream that ended without ``[DONE]`` and without an error event, a
  body that is not the JSON it claims to be, or no answer within the client timeout. Must be 0.

After each fault the runner waits (bounded) until the shared store's in-flight counts and every live
replica's running requests are back to 0 (``phantom_after`` = what remains when that wait ends; must be
0), and reports CHR (Σ cached / Σ prompt tokens from the streams' usage) in the phase before the fault,
during it, and in the phase after it. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtests.bench import emit_json
from loadtests.procs import Procs, read_line

__all__ = ["ALL_FAULTS", "Outcomes", "cli_main", "run_campaign"]

PY = sys.executable
ADMIN_TOKEN = "faults-admin-token-0123456789"
ALL_FAULTS = (
    "replica_503",
    "replica_hang",
    "replica_slow",
    "replica_break_midstream",
    "replica_sigkill",
    "redis_sigkill_restart",
    "redis_latency",
    "gateway_sigkill",
    "scale_up",
    "drain",
)


Observer = Callable[[str, str, str, int, int], None]
"""Told of each completed request: session id, replica, route reason, prompt and cached tokens."""


@dataclass
class Outcomes:
    completed: int = 0
    clean_error: int = 0
    lost: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # per SSE error event: the replica that served it and when its request started
    stream_errors: list[tuple[str, float]] = field(default_factory=list)

    def chr(self) -> float | None:
        return round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None

    def error(self, kind: str) -> None:
        self.clean_error += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


# ---- processes ---------------------------------------------------------------------------------------


async def start_emulator(
    procs: Procs, time_scale: float, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    p = procs.start([PY, "-m", "router.cli", "emulate", "--replicas", "1", "--base-port", "0", "--profile", "small-test",
                     "--time-scale", str(time_scale), *extra])  # fmt: skip
    url = await read_line(p.stdout)
    if not url.startswith("http://"):
        raise RuntimeError(f"emulator did not start: {url!r}")
    procs.drain(p)
    return p, url


async def start_gateway_proc(
    procs: Procs, replicas: list[str], redis_url: str | None, gid: str, extra: Sequence[str] = (), port: int = 0
) -> tuple[subprocess.Popen[bytes], str]:
    """A ``kvroute serve`` process on ``port`` (0: a free one), on ``redis_url`` or embedded state (None)."""
    args = [PY, "-m", "router.cli", "serve", "--port", str(port), "--gateway-id", gid, "--max-retries", "2",
            *(["--redis", redis_url] if redis_url else [])]  # fmt: skip
    for r in replicas:
        args += ["--replica", r]
    args += ["--set", "health.health_interval_s=0.2", "--set", "health.scrape_interval_s=0.2",
             "--set", "health.unhealthy_threshold=2", "--set", "health.healthy_threshold=1",
             "--set", "timeouts.first_byte_s=3", "--set", "timeouts.idle_read_s=3", "--set", "timeouts.connect_s=1",
             "--set", "timeouts.shutdown_s=2", "--set", "store.lease_ttl_s=2", *extra]  # fmt: skip
    p = procs.start(args, stderr_pipe=True)
    while True:
        line = await read_line(p.stderr)
        if "gateway listening on" in line:
            procs.drain(p)  # its warnings (one per cut stream) must never fill the pipe
            return p, line.rsplit(" ", 1)[-1]
        if not line and p.poll() is not None:
            raise RuntimeError("gateway did not start")


# ---- load ---------------------------------------------------------------------------------------------


class Load:
    """Closed-loop sessions; each request lands in exactly one bucket of the current phase."""

    def __init__(
        self, gateways: list[str], clients: int, seed: int, timeout_s: float, observe: Observer | None = None
    ) -> None:
        self.gateways = list(gateways)
        self.observe = observe  # told of every completed request (``loadtests.bench_restart``)
        self.dead: set[str] = set()
        self.clients = clients
        self.rng = random.Random(seed)
        self.timeout_s = timeout_s
        self.phase = Outcomes()
        self.stop = asyncio.Event()
        self.in_flight = 0
        self.streaming: dict[str, int] = {}  # replica id or gateway URL -> streams that sent the client bytes

    def new_phase(self) -> Outcomes:
        old, self.phase = self.phase, Outcomes()
        return old

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._client(session, i) for i in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        rng = random.Random(self.rng.random())
        sid, history, turn = f"fc{i}-0", f"system prompt of client {i}: " + "tools " * 300, 0
        refused = False
        while not self.stop.is_set():
            if not refused:  # a turn no gateway took is sent again, as an agent would
                turn += 1
                if turn % 12 == 0:  # sessions end and new ones begin
                    sid, history = f"fc{i}-{turn}", f"system prompt of client {i}: " + "tools " * 300
                history += f" user turn {turn}: " + "code " * rng.randint(20, 60)
                # every third turn is a long answer, so that kills land mid-stream
                body = {"model": "m", "messages": [{"role": "user", "content": history}], "stream": True,
                        "max_tokens": 48 if turn % 3 else 400, "stream_options": {"include_usage": True}}  # fmt: skip
            live = [g for g in self.gateways if g not in self.dead] or self.gateways
            gw = live[i % len(live)]
            self.in_flight += 1
            refused = False
            try:
                refused = await asyncio.wait_for(self._one(session, gw, sid, body), self.timeout_s)
            except TimeoutError:
                self.phase.lost += 1
                self.phase.errors["client_timeout"] = self.phase.errors.get("client_timeout", 0) + 1
            finally:
                self.in_flight -= 1
            await asyncio.sleep(rng.uniform(0.01, 0.1))  # think time

    async def _one(self, session: aiohttp.ClientSession, gw: str, sid: str, body: dict[str, Any]) -> bool:
        """One request, counted; True when no gateway took the connection."""
        ph = self.phase  # a request counts in the phase it started in
        t0 = time.monotonic()
        try:
            async with session.post(gw + "/v1/chat/completions", json=body, headers={"Modal-Session-Id": sid}) as r:
                rid, reason = r.headers.get("X-Kvroute-Replica", ""), r.headers.get("X-Kvroute-Reason", "")
                if r.status == 200:
                    first = await r.content.readany()
                    self.streaming[rid] = self.streaming.get(rid, 0) + 1
                    self.streaming[gw] = self.streaming.get(gw, 0) + 1
                    try:
                        raw = first + await r.read()
                    finally:
                        self.streaming[rid] -= 1
                        self.streaming[gw] -= 1
                else:
                    raw = await r.read()
                if r.status != 200:
                    try:
                        err = json.loads(raw)["error"]
                        ph.error(f"http_{r.status}_{err.get('code', '')}")
                    except (ValueError, KeyError, TypeError):
                        ph.lost += 1
                        ph.errors["non_json_error"] = ph.errors.get("non_json_error", 0) + 1
                    return False
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            ph.error(type(exc).__name__)
            if isinstance(exc, aiohttp.ClientConnectorError):
                self.dead.add(gw)
                return True
            return False
        text = raw.decode("utf-8", "replace")
        events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
        if any('"error"' in e for e in events if e != "[DONE]"):
            ph.error("sse_error_event")
            ph.stream_errors.append((rid, t0))
            return False
        if not events or events[-1] != "[DONE]":
            ph.lost += 1
            ph.errors["silent_truncation"] = ph.errors.get("silent_truncation", 0) + 1
            return False
        ph.completed += 1
        for e in reversed(events[:-1]):
            with contextlib.suppress(ValueError):
                usage = json.loads(e).get("usage")
                if usage:
                    prompt = int(usage.get("prompt_tokens") or 0)
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                    ph.prompt_tokens += prompt
                    ph.cached_tokens += cached
                    if self.observe is not None:
                        self.observe(sid, rid, reason, prompt, cached)
                    break
        return False


# ---- the campaign ---------------------------------------------------------------------------------


@dataclass
class Fleet:
    procs: Procs
    emulators: dict[str, subprocess.Popen[bytes]]  # url -> process
    gateways: dict[str, subprocess.Popen[bytes]]  # url -> process
    redis: Any  # loadtests.redis_server.RedisServer
    proxy: Any  # loadtests.tcp_proxy.TcpProxy
    redis_url: str  # through the proxy
    time_scale: float

    def live_replicas(self) -> list[str]:
        return [u for u, p in self.emulators.items() if p.poll() is None]


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None, method: str = "POST") -> int:
    async with s.request(method, url, json=body) as r:
        await r.read()
        return r.status


async def _admin(s: aiohttp.ClientSession, gw: str, method: str, path: str, body: dict[str, Any] | None = None) -> int:
    hdrs = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with s.request(method, gw + "/admin" + path, json=body, headers=hdrs) as r:
        await r.read()
        return r.status


async def _replica_running(s: aiohttp.ClientSession, url: str) -> int:
    try:
        async with s.get(url + "/metrics", headers={"Accept": "text/plain"}, timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0  # a dead replica runs nothing
    total = 0.0
    for ln in text.splitlines():
        if ln.startswith(("sglang:num_running_reqs", "sglang:num_queue_reqs")):
            total += float(ln.rsplit(" ", 1)[-1])
    return int(total)


async def _store_in_flight(redis_direct_url: str) -> int:
    from router.clock import SystemClock
    from router.store.base import StoreConfig
    from router.store.redis import RedisStore

    store = RedisStore.from_url(redis_direct_url, "faults-observer", StoreConfig(lease_ttl_s=2.0), SystemClock(),
                                op_timeout_s=2.0)  # fmt: skip
    try:
        snap = await store.snapshot(None)
        return sum(r.in_flight for r in snap.replicas)
    finally:
        await store.close()


async def _phantom(s: aiohttp.ClientSession, fleet: Fleet, load: Load, timeout_s: float) -> dict[str, int | float]:
    """Pause the load, wait (bounded) until store in-flight and replicas' running are 0."""
    t0 = time.monotonic()
    store = running = -1
    while time.monotonic() - t0 < timeout_s:
        if load.in_flight == 0:
            try:
                store = await _store_in_flight(fleet.redis.url)
            except Exception:  # noqa: BLE001 - Redis may be down in this very phase: retry
                store = -1
            running = sum([await _replica_running(s, u) for u in fleet.live_replicas()])
            if store == 0 and running == 0:
                break
        await asyncio.sleep(0.1)
    return {"store_in_flight": store, "replica_running": running, "settle_s": round(time.monotonic() - t0, 2)}


async def _apply(name: str, s: aiohttp.ClientSession, fleet: Fleet, load: Load, phase_s: float) -> dict[str, Any]:
    """Apply one fault for one phase; return notes. The caller measures before/during/after."""
    reps = fleet.live_replicas()
    victim = reps[0]
    gws = list(fleet.gateways)
    notes: dict[str, Any] = {}
    if name == "replica_503":
        await _post(s, victim + "/_emulator/faults", {"status": 503})
        await asyncio.sleep(phase_s)
        await _post(s, victim + "/_emulator/faults", method="DELETE")
    elif name == "replica_hang":
        await _post(s, victim + "/_emulator/faults", {"hang": True})
        await asyncio.sleep(phase_s)
        await _post(s, victim + "/_emulator/faults", method="DELETE")
    elif name == "replica_slow":
        await _post(s, victim + "/_emulator/faults", {"slow_factor": 20.0})
        await asyncio.sleep(phase_s)
        await _post(s, victim + "/_emulator/faults", method="DELETE")
    elif name == "replica_break_midstream":
        await _post(s, victim + "/_emulator/faults", {"break_after_chunks": 2})
        await asyncio.sleep(phase_s)
        await _post(s, victim + "/_emulator/faults", method="DELETE")
    elif name == "replica_sigkill":
        # kill while clients are mid-stream on the victim (bytes received; bounded wait)
        vid = victim.removeprefix("http://")
        deadline = time.monotonic() + 5.0
        while load.streaming.get(vid, 0) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        notes["victim_streams_mid_way_at_kill"] = load.streaming.get(vid, 0)
        notes["killed_at"] = time.monotonic()
        fleet.emulators[victim].send_signal(signal.SIGKILL)
        fleet.emulators[victim].wait(10)
        notes["killed"] = victim
        await asyncio.sleep(phase_s)
    elif name == "redis_sigkill_restart":
        fleet.redis.kill()
        await asyncio.sleep(phase_s / 2)
        fleet.redis.start()
        await asyncio.sleep(phase_s / 2)
    elif name == "redis_latency":
        fleet.proxy.latency_s = 0.05
        notes["added_latency_ms_each_way"] = 50
        await asyncio.sleep(phase_s)
        fleet.proxy.latency_s = 0.0
    elif name == "gateway_sigkill":
        dead = gws[-1]
        deadline = time.monotonic() + 5.0
        while load.streaming.get(dead, 0) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.002)
        notes["streams_mid_way_at_kill"] = load.streaming.get(dead, 0)
        fleet.gateways[dead].send_signal(signal.SIGKILL)
        fleet.gateways[dead].wait(10)
        notes["killed"] = dead
        await asyncio.sleep(phase_s)
    elif name == "scale_up":
        p, url = await start_emulator(fleet.procs, fleet.time_scale)
        fleet.emulators[url] = p
        live_gw = [g for g in gws if fleet.gateways[g].poll() is None]
        notes["admin_status"] = await _admin(s, live_gw[0], "POST", "/replicas", {"url": url})
        notes["added"] = url
        await asyncio.sleep(phase_s)
    elif name == "drain":
        live_gw = [g for g in gws if fleet.gateways[g].poll() is None]
        rid = victim.removeprefix("http://")
        notes["admin_status"] = await _admin(s, live_gw[0], "POST", f"/replicas/{rid}/drain")
        notes["drained"] = victim
        await asyncio.sleep(phase_s)
    else:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(ALL_FAULTS)}")
    return notes


def _stream_error_origins(tot: Outcomes, notes: dict[str, Any]) -> dict[str, int]:
    """For a killed replica: SSE error events that did *not* come from a stream the gateway had already
    begun on it. The gateway retries a request elsewhere until it has sent the client a 200, so each
    error event must name the victim and belong to a request that started before the kill. Judged
    after the fact: at the kill a stream's first bytes can still be in a socket buffer."""
    if "killed_at" not in notes:
        return {}
    vid = str(notes["killed"]).removeprefix("http://")
    stray = sum(1 for rid, t0 in tot.stream_errors if rid != vid or t0 >= notes["killed_at"])
    return {"stream_errors_not_under_way_at_kill": stray}


def _recovered(before: float | None, after: float | None, tolerance: float = 0.05) -> bool:
    return before is not None and after is not None and after >= before - tolerance


async def run_campaign(
    faults: tuple[str, ...] = ALL_FAULTS,
    *,
    replicas: int = 4,
    clients: int = 16,
    phase_s: float = 4.0,
    time_scale: float = 0.05,
    seed: int = 1,
    client_timeout_s: float = 20.0,
    settle_timeout_s: float = 15.0,
    chr_tolerance: float = 0.05,
    log: Callable[[str], None] | None = None,
    gateway_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the campaign; see the module docstring. Bounded: about ``(3 * phase_s + settle) * len(faults)``."""
    from loadtests.redis_server import RedisServer
    from loadtests.tcp_proxy import TcpProxy

    say = log or (lambda _m: None)
    procs = Procs({"KVROUTE_ADMIN_TOKEN": ADMIN_TOKEN})
    redis = RedisServer().start()
    proxy = await TcpProxy("127.0.0.1", redis.port).start()
    results: list[dict[str, Any]] = []
    try:
        emus = await asyncio.gather(*(start_emulator(procs, time_scale) for _ in range(replicas)))
        redis_url = f"redis://127.0.0.1:{proxy.port}/0"
        urls = [u for _, u in emus]
        gws = await asyncio.gather(
            *(start_gateway_proc(procs, urls, redis_url, f"fgw{i}", gateway_args) for i in range(2))
        )
        fleet = Fleet(procs, {u: p for p, u in emus}, {u: p for p, u in gws}, redis, proxy, redis_url, time_scale)
        load = Load([u for _, u in gws], clients, seed, client_timeout_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await asyncio.sleep(1.0)  # first health rounds
            runner: Awaitable[None] = load.run(s)
            task = asyncio.ensure_future(runner)
            await asyncio.sleep(phase_s)  # warm-up: sessions get homes and caches
            for k, name in enumerate(faults):
                say(f"fault {name}")
                # A request is counted in the phase object current when it *started*, whenever it ends;
                # every object of the fault's window goes into its totals, so nothing escapes counting
                # (the streams in flight when the fault hits belong to ``before``).
                lead = load.new_phase()  # since the load (re)started: warm-up or the previous restart
                await asyncio.sleep(phase_s)
                before = load.new_phase()
                notes = await _apply(name, s, fleet, load, phase_s)
                during = load.new_phase()
                await asyncio.sleep(phase_s)
                after = load.new_phase()
                load.stop.set()
                phantom = await _phantom(s, fleet, load, settle_timeout_s)
                late = load.new_phase()  # requests that were in flight when the load paused
                await asyncio.wait_for(task, client_timeout_s + 5)
                if k + 1 < len(faults):
                    load.stop = asyncio.Event()
                    task = asyncio.ensure_future(load.run(s))
                tot = Outcomes()
                for o in (lead, before, during, after, late):
                    tot.completed += o.completed
                    tot.clean_error += o.clean_error
                    tot.lost += o.lost
                    tot.stream_errors += o.stream_errors
                    for kind, n in o.errors.items():
                        tot.errors[kind] = tot.errors.get(kind, 0) + n
                results.append({
                    "fault": name,
                    "completed": tot.completed,
                    "clean_errors": tot.clean_error,
                    "lost": tot.lost,
                    "error_kinds": tot.errors,
                    "phantom_after": int(max(0, phantom["store_in_flight"]) + max(0, phantom["replica_running"]))
                    if phantom["store_in_flight"] >= 0 else -1,
                    "phantom_detail": phantom,
                    "chr_before": before.chr(),
                    "chr_during": during.chr(),
                    "chr_after": after.chr(),
                    "chr_recovered": _recovered(before.chr(), after.chr(), chr_tolerance),
                    "requests_before": before.completed + before.clean_error + before.lost,
                    **_stream_error_origins(tot, notes),
                    **{k: v for k, v in notes.items() if k != "killed_at"},  # (a monotonic instant)
                })  # fmt: skip
            load.stop.set()
            await asyncio.wait_for(task, client_timeout_s + 5)  # done already unless faults was empty
    finally:
        await proxy.close()
        procs.cleanup()
        redis.cleanup()
    return {
        "bench": "faults",
        "replicas": replicas,
        "clients": clients,
        "phase_s": phase_s,
        "time_scale": time_scale,
        "gateways": 2,
        "faults": results,
        "total_lost": sum(r["lost"] for r in results),
        "total_phantom_after": sum(max(0, r["phantom_after"]) for r in results),
        "all_ok": all(r["lost"] == 0 and r["phantom_after"] == 0 and r["chr_recovered"] for r in results),
    }


def cli_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvroute bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", default=",".join(ALL_FAULTS), help=f"comma list of: {', '.join(ALL_FAULTS)}")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--phase-s", type=float, default=4.0)
    p.add_argument("--time-scale", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output", metavar="PATH", help="also write the JSON here")
    p.add_argument(
        "--chr-tolerance",
        type=float,
        default=0.05,
        help="CHR after a fault may be this much below CHR before it and still count as recovered "
        "(short phases hold few requests: widen it for smoke runs)",
    )
    p.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG",
        help="extra `kvroute serve` argument of both gateways (repeatable), e.g. --gateway-arg=--no-decision-headers",
    )
    a = p.parse_args(argv)
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip())
    bad = [f for f in faults if f not in ALL_FAULTS]
    if bad or a.replicas < 2 or a.clients < 1 or a.phase_s <= 0 or not 0 <= a.chr_tolerance <= 1:
        print(f"kvroute bench faults: bad arguments (unknown faults {bad}; need replicas >= 2)", file=sys.stderr)
        return 2
    out = asyncio.run(run_campaign(faults, replicas=a.replicas, clients=a.clients, phase_s=a.phase_s,
                                   time_scale=a.time_scale, seed=a.seed, chr_tolerance=a.chr_tolerance,
                                   gateway_args=a.gateway_arg,
                                   log=lambda m: print(m, file=sys.stderr, flush=True)))  # fmt: skip
    emit_json(out, a.output)
    return 0 if out["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(cli_main(sys.argv[1:]))
